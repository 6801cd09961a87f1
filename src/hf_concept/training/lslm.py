"""LSLM's update schedules: joint (`update_schedule=0`, the default: every optimizer step updates the
generative model θ and the inference network φ together) or the paper's interleaving (LSLM §2.6, k ≥ 1:
k optimizer steps update θ, everything but the router, then one step updates φ, the router).

The rule is `drop_other_group_gradients`: just before optimizer step s (0-based) it sets to None the
gradients of the group that step s does not update, so torch's optimizers leave those parameters — and
their moment estimates and weight decay — untouched on that step. Call it after gradient clipping, whose
norm therefore still spans both groups. `InterleavedUpdates` applies it under `Trainer`; a manual loop
calls it between `clip_grad_norm_` and `optimizer.step()`.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers import TrainerCallback


def is_inference_parameter(name: str) -> bool:
    """The router's parameters form the inference network q(z | x); everything else is generative."""
    return ".router." in f".{name}"


def update_phase(step: int, generator_steps: int) -> str:
    """ "joint", "generator" or "inference": which group optimizer step `step` (0-based) updates, for k =
    `generator_steps` (0: both at every step; k ≥ 1: steps s with s % (k + 1) == k update the router)."""
    if not (
        isinstance(generator_steps, int) and not isinstance(generator_steps, bool) and generator_steps >= 0
    ):
        raise ValueError(f"generator_steps={generator_steps!r} must be 0 (joint) or a positive integer")
    if generator_steps == 0:
        return "joint"
    return "inference" if step % (generator_steps + 1) == generator_steps else "generator"


def drop_other_group_gradients(model: nn.Module, step: int, generator_steps: int) -> str:
    """Set `.grad = None` on the parameters that optimizer step `step` must not update; returns the phase.

    Generator steps keep every gradient but the router's, inference steps only the router's, joint steps
    every gradient.
    """
    phase = update_phase(step, generator_steps)
    if phase == "joint":
        return phase
    keep_router = phase == "inference"
    for name, parameter in model.named_parameters():
        if is_inference_parameter(name) != keep_router:
            parameter.grad = None
    return phase


class InterleavedUpdates(TrainerCallback):
    """`Trainer` callback: steps s with s % (k + 1) == k update the router only, the others the rest; with
    k = 0 every step updates both (nothing is dropped).

    `generator_steps` is k; None reads the model config's `update_schedule`.
    """

    def __init__(self, generator_steps: int | None = None) -> None:
        if generator_steps is not None:
            update_phase(0, generator_steps)  # raises for anything but 0 or a positive integer
        self.generator_steps = generator_steps

    def phase(self, step: int, generator_steps: int) -> str:
        """ "generator" or "inference" for optimizer step `step` (0-based)."""
        return update_phase(step, generator_steps)

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
        drop_other_group_gradients(model, state.global_step, steps)
        return control
