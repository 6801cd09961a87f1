"""The optimizer step's statistics for the "global" ratio-loss scope (routing.py's module docstring):
running counts over accumulated micro-batches, and the step plan that makes them exact.

Legend: B batch, L tokens.

Why a plan. The share of micro-batch i is slope(F)·S_i/N + intercept(F)·n_i/N, where F is the fraction
of the step's tokens that open a chunk. Micro-batch i runs backward before the later ones exist, so
without a plan it uses the running F of micro-batches 1..i. `plan_ratio_step` removes that: before the
step's first forward it runs each micro-batch up to its boundary decisions (no gradient, and nothing
after the router: the forward stops there), keeps each micro-batch's decisions and sums the step's
counts over micro-batches and ranks. The training forwards then replay those decisions, so F, G and N are
the step's from the first micro-batch on, and k micro-batches give one big batch's loss and gradients.
The cost is one gradient-free pass of the embeddings and encoder layers per micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist


def all_reduce_sum(counts: torch.Tensor, process_group=None) -> torch.Tensor:
    """`counts` summed over the ranks of `process_group` (itself without torch.distributed)."""
    if dist.is_available() and dist.is_initialized():
        counts = counts.clone()
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=process_group)
    return counts


def scope_counts(prob_sum: torch.Tensor, boundaries: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(3,) float64, detached: (boundaries, sum of p, tokens) over the real tokens of (B, L) `boundaries`
    and `mask`, with `prob_sum` the sum of p over them: the counts a ratio-loss scope is made of."""
    opens = (boundaries & mask).sum().to(torch.float64)
    return torch.stack([opens, prob_sum.detach().to(torch.float64), mask.sum().to(torch.float64)])


class _BoundariesDrawn(Exception):  # noqa: N818 (a stop signal for the planning forward, not an error)
    """Ends a planning forward once the micro-batch's decisions exist: nothing after them is needed."""

    def __init__(self, probs: torch.Tensor, boundaries: torch.Tensor, mask: torch.Tensor) -> None:
        super().__init__("boundaries drawn")
        self.probs, self.boundaries, self.mask = probs, boundaries, mask


class RatioAccumulator:
    """Boundary and token counts of one optimizer step, for the "global" ratio-loss scope.

    Create it with the number of micro-batches per optimizer step (gradient accumulation steps) and call
    `reset` at the start of every optimizer step. Pass `step_token_count` to `reset`, the real tokens of
    the whole step over all ranks, to make the denominator exact. `Trainer` fetches a step's
    micro-batches up front, so this count is known before the first forward. All counts here are
    global, already summed over ranks. After `plan_ratio_step`, every micro-batch sees the step's own
    counts (module docstring); without it, the counts of the micro-batches seen so far.
    """

    def __init__(self, num_micro_batches: int) -> None:
        if not (isinstance(num_micro_batches, int) and num_micro_batches >= 1):
            raise ValueError(f"num_micro_batches must be an int >= 1, got {num_micro_batches!r}")
        self.num_micro_batches = num_micro_batches
        self.reset()

    def reset(self, step_token_count: int | torch.Tensor | None = None) -> None:
        """Start a new optimizer step (and drop the last step's plan)."""
        if isinstance(step_token_count, int) and step_token_count < 0:
            raise ValueError(f"step_token_count must be >= 0, got {step_token_count}")
        self.step_token_count = step_token_count
        self.micro_batches_seen = 0
        # float64 (boundaries, sum of p, tokens) over the micro-batches seen so far.
        self.running_counts: torch.Tensor | None = None
        # The plan: each micro-batch's (B, L) decisions, to replay in order, and the step's counts.
        self.planned_boundaries: list[torch.Tensor] | None = None
        self.planned_counts: torch.Tensor | None = None
        self.recording = False

    def update(self, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add one micro-batch's global counts (3,); return the step's counts so far (all of them once
        planned) and the denominator N."""
        if self.micro_batches_seen >= self.num_micro_batches:
            raise ValueError(
                f"RatioAccumulator got more than num_micro_batches={self.num_micro_batches} micro-batches; "
                "call reset() at the start of every optimizer step"
            )
        self.micro_batches_seen += 1
        running = counts if self.running_counts is None else self.running_counts + counts
        self.running_counts = running
        if self.planned_counts is not None:
            planned = self.planned_counts.to(device=counts.device, dtype=counts.dtype)
            return planned, planned[2]
        if self.step_token_count is not None:
            denominator = torch.as_tensor(self.step_token_count, dtype=counts.dtype, device=counts.device)
        else:
            denominator = running[2] * (self.num_micro_batches / self.micro_batches_seen)
        return running, denominator

    def decide(
        self, probs: torch.Tensor, mask: torch.Tensor, draw: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        """(B, L) training decisions of the next micro-batch: `draw()` without a plan; while planning,
        `draw()` then the end of the planning forward; with a plan, the planned decisions."""
        if self.recording:
            raise _BoundariesDrawn(probs.detach(), draw(), mask)
        if self.planned_boundaries is None:
            return draw()
        if not self.planned_boundaries:
            raise ValueError(
                "a training forward ran after the step's planned micro-batches were used up; "
                "call reset() at the start of every optimizer step and plan_ratio_step() with all of its "
                "micro-batches"
            )
        planned = self.planned_boundaries.pop(0)
        if planned.shape != probs.shape:
            raise ValueError(
                f"the micro-batch's boundaries have shape {tuple(probs.shape)} but the plan has "
                f"{tuple(planned.shape)}: pass plan_ratio_step() the micro-batches in the order they run"
            )
        return planned.to(probs.device)


@torch.no_grad()
def plan_ratio_step(
    model: torch.nn.Module, micro_batches: Iterable[dict[str, Any]], process_group=None
) -> bool:
    """Plan the step of `model.ratio_accumulator` (reset for this step) over `micro_batches`, the model
    inputs of each micro-batch in the order training will run them (module docstring). Every rank must
    call it, with its own micro-batches: the step's counts are summed over ranks. Returns False, with no
    plan made, for a model that draws no boundaries (its forward ran to the end)."""
    accumulator = model.ratio_accumulator
    planned, counts = [], None
    accumulator.recording = True
    try:
        for inputs in micro_batches:
            inputs = {key: value for key, value in inputs.items() if key != "labels"}
            try:
                model(**inputs, use_cache=False)
            except _BoundariesDrawn as drawn:
                prob_sum = torch.where(drawn.mask, drawn.probs, 0.0).sum()
                micro = scope_counts(prob_sum, drawn.boundaries, drawn.mask)
                counts = micro if counts is None else counts + micro
                planned.append(drawn.boundaries)
            else:
                return False
    finally:
        accumulator.recording = False
    if counts is None:
        return False
    accumulator.planned_counts = all_reduce_sum(counts, process_group)
    accumulator.planned_boundaries = planned
    return True
