"""LSLM's interleaved optimisation (LSLM §2.6) under `Trainer`: k optimizer steps update the generative
model θ (everything but the router), then one step updates the inference network φ (the router).

The callback drops the other group's gradients just before each optimizer step (after gradient
clipping, whose norm therefore still spans both groups), so torch's optimizers leave those parameters —
and their moment estimates — untouched on that step.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback


def is_inference_parameter(name: str) -> bool:
    """The router's parameters form the inference network q(z | x); everything else is generative."""
    return ".router." in f".{name}"


class InterleavedUpdates(TrainerCallback):
    """`Trainer` callback: steps s with s % (k + 1) == k update the router only, the others the rest.

    `generator_steps` is k; None reads the model config's `update_schedule`.
    """

    def __init__(self, generator_steps: int | None = None) -> None:
        if generator_steps is not None and not (isinstance(generator_steps, int) and generator_steps >= 1):
            raise ValueError(f"generator_steps={generator_steps!r} must be None or a positive integer")
        self.generator_steps = generator_steps

    def phase(self, step: int, generator_steps: int) -> str:
        """ "generator" or "inference" for optimizer step `step` (0-based)."""
        return "inference" if step % (generator_steps + 1) == generator_steps else "generator"

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs: Any):
        if model is None:
            raise ValueError("InterleavedUpdates needs the model (Trainer passes it to callbacks)")
        steps = self.generator_steps
        if steps is None:
            steps = getattr(getattr(model, "config", None), "update_schedule", None)
            if steps is None:
                raise ValueError(
                    f"model of type {type(model).__name__} has no config.update_schedule; "
                    "pass generator_steps"
                )
        keep_router = self.phase(state.global_step, steps) == "inference"
        for name, parameter in model.named_parameters():
            if is_inference_parameter(name) != keep_router:
                parameter.grad = None
        return control
