"""Small helpers shared by the tools (not by the model folder, which imports nothing from here)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Run the block with `model` in eval mode, then give it back its training flag."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
