"""Hold a ConceptMoE's realised tokens per concept at its target by moving the router's threshold.

Why: a checkpoint converted from a dense source at R > 1 starts above its source's loss, and the cheapest
way for continued training to lower the LM loss is to open a concept at every token, which turns the
model back into its source. On SmolLM2-135M the ratio loss did not stop that (λ = 0.03 and 1.0 fell to
about one token per concept within a few dozen steps; λ = 10 held the ratio but stalled the LM loss;
REPRODUCTION.md). Holding the ratio by the threshold instead leaves the LM gradient free to decide
*which* tokens open concepts (the ranking of the router's probabilities) while *how many* is fixed.

The rule: after every optimizer step, the batches of that step are run again, without gradients and
only as far as the router (the early layers), and the threshold becomes the value at which thresholding
their boundary probabilities (the inference rule, p_t ≥ threshold) gives one concept per `ratio` tokens,
document starts included. Measuring with the updated weights matters: the LM keeps raising every
probability a little, and a threshold taken from the step's own forward lags one update behind (on
SmolLM2 that lag alone let the realised ratio slip from 2 to about 1.5 within 15 steps). The config keeps
the last value, so a saved checkpoint infers at the ratio it was trained at. Training decides by the
same rule without noise (`boundary_noise="none"`), so training and inference segment alike; the LM
gradient still reaches the router through the straight-through factor. (With Gaussian noise of the
default σ = 0.1 they did not: the LM pushes every probability toward 1, the held threshold followed to
about 0.97, and noise of that size against probabilities bunched near 1 turned a held 1.5 tokens per
concept at inference into about 1.9 in training on SmolLM2.) With several processes each sets its own
threshold from its own batches.

Under `boundary_rank_window` the decisions read local ranks instead of probabilities
(`modeling.concept_ranking`), and the held threshold is a threshold on those ranks: the window already
gives every text about one concept per R tokens, and the hold corrects what is left, so that the mix
realises R exactly, while a threshold on the probabilities meets R on the mix by spending it on the
languages whose probabilities sit highest.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback


def threshold_for_ratio(probs: torch.Tensor, starts: torch.Tensor, mask: torch.Tensor, ratio: float) -> float:
    """The threshold under which `probs ≥ threshold` opens one concept per `ratio` real tokens.

    probs, starts, mask: (B, L). Starts always open a concept, so the free tokens (real, not a start)
    supply the rest: k = round(n / ratio) − (number of starts) of them, the k most probable. Returns the
    k-th largest free probability (ties may open a few more), or 1.0 when no free token is needed (a
    probability of exactly 1.0 still opens one), 0.0 when all are.
    """
    if not ratio >= 1:
        raise ValueError(f"ratio={ratio!r} must be >= 1 (tokens per concept)")
    free = probs[mask & ~starts].detach().float()
    wanted = round(int(mask.sum()) / ratio) - int((starts & mask).sum())
    if wanted <= 0 or free.numel() == 0:
        return 1.0
    if wanted >= free.numel():
        return 0.0
    return float(torch.topk(free, wanted).values[-1].clamp(0.0, 1.0))


class _RouterReachedError(Exception):
    """Ends a measuring forward once the router has run."""


def conceptmoe_stacks(model: nn.Module) -> list[nn.Module]:
    """The ConceptMoE stacks (`ConceptMoEModel`) inside `model` (a causal LM, a PEFT wrapper, ...)."""
    from ..modeling.modeling_conceptmoe import ConceptMoEModel

    return [module for module in model.modules() if isinstance(module, ConceptMoEModel)]


@torch.no_grad()
def router_inputs(stack: nn.Module, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
    """(scores, starts, mask), each (B, L): what the router's decisions threshold in a forward of `stack`
    with these arguments — its probabilities, or their local ranks under `boundary_rank_window` — run
    without gradients only as far as the router (the early layers)."""
    found = []
    decision_scores = stack.decision_scores

    def stop(probs: torch.Tensor, starts: torch.Tensor, mask: torch.Tensor, *rest: Any) -> None:
        # The forward's own call (a measuring forward has no cache: its rows start from the empty state).
        found.append((decision_scores(probs, starts, mask, *rest)[0], starts, mask))
        raise _RouterReachedError

    own = stack.__dict__.get("decision_scores")  # an override already on the instance, put back after
    stack.decision_scores = stop
    try:
        stack(*args, **kwargs)
    except _RouterReachedError:
        pass
    finally:
        del stack.decision_scores
        if own is not None:
            stack.decision_scores = own
    if not found:
        raise RuntimeError("the ConceptMoE stack returned without running its router (fixed chunking?)")
    return found[0]


class RatioHold(TrainerCallback):
    """Keeps `config.boundary_threshold` of every ConceptMoE stack in `model` at `threshold_for_ratio`.

    A forward pre-hook on each stack keeps the inputs of each training forward; `update()` (called by
    `Trainer` at every step end, or by hand after `optimizer.step()`) re-runs them up to the router and
    sets the mean threshold over them. `remove()` detaches the hooks.
    """

    def __init__(self, model: nn.Module, ratio: float) -> None:
        if not ratio >= 1:
            raise ValueError(f"ratio={ratio!r} must be >= 1 (tokens per concept)")
        stacks = conceptmoe_stacks(model)
        if not stacks:
            raise ValueError(f"{type(model).__name__} has no ConceptMoE stack whose ratio could be held")
        self.ratio, self.stacks, self.calls, self.measuring = ratio, stacks, [], False
        for stack in stacks:
            stack.config.boundary_noise = "none"
        self.hooks = [stack.register_forward_pre_hook(self._keep, with_kwargs=True) for stack in stacks]

    def _keep(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if module.training and not self.measuring:
            self.calls.append((module, args, kwargs))

    def update(self) -> float | None:
        """Sets and returns the new threshold (None, and nothing changed, when no forward was kept)."""
        if not self.calls:
            return None
        self.measuring = True
        try:
            values = [
                threshold_for_ratio(*router_inputs(stack, *args, **kwargs), self.ratio)
                for stack, args, kwargs in self.calls
            ]
        finally:
            self.measuring = False
        self.calls.clear()
        threshold = sum(values) / len(values)
        for stack in self.stacks:
            stack.config.boundary_threshold = threshold
        return threshold

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.update()

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []


def calibrate_threshold(model: nn.Module, batches: list[torch.Tensor], ratio: float) -> float:
    """Sets `boundary_threshold` of every ConceptMoE stack in `model` from many batches at once and
    returns it: the threshold at which their pooled probabilities open one concept per `ratio` tokens.

    `RatioHold` sets it from one step's batches, whose mix of text varies from step to step; run this
    before saving so that the saved threshold holds the ratio over a larger sample. Each batch is (B, L)
    `input_ids` without padding; each runs only as far as the router."""
    stacks = conceptmoe_stacks(model)
    if not stacks or not batches:
        raise ValueError("calibrate_threshold needs a ConceptMoE model and at least one batch")
    measured = [router_inputs(stacks[0], input_ids=input_ids) for input_ids in batches]
    pooled = (torch.cat([part.flatten() for part in parts])[None] for parts in zip(*measured, strict=True))
    probs, starts, masks = pooled
    threshold = threshold_for_ratio(probs, starts, masks, ratio)
    for stack in stacks:
        stack.config.boundary_threshold = threshold
    return threshold
