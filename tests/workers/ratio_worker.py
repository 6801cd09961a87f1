"""torchrun worker for tests/test_distributed_ratio.py: the "global" ratio loss on two ranks (gloo, CPU).

Usage: python -m torch.distributed.run --nproc_per_node 2 tests/workers/ratio_worker.py OUT_DIR

Every rank builds the same seeded cosine router and the same fixed batch, takes its half of the rows
(rank r gets rows 2r and 2r + 1, whose token counts differ between ranks), and writes OUT_DIR/rank{r}.pt:
- global scope, one micro-batch: F, G, value, token count, its local gradients and the gradients after
  an all_reduce(SUM);
- batch scope on the local half (what a per-rank loss would give), with its local gradients;
- global scope over two accumulated micro-batches of one row each: the final F, G, value, token count.

The parent test imports `build_problem`, `build_router` and `router_ratio_loss` to compute the
single-process result on the whole batch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hf_concept.modeling.packing import document_starts
from hf_concept.modeling.routing import (
    RatioAccumulator,
    RatioLossOutput,
    boundary_decisions_from_noise,
    cosine_boundary_probs,
    ratio_loss,
)

TARGET_RATIO = 3.0


def build_problem() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token_states (4, 7, 6), mask, starts, uniforms (4, 7)): padded, plain and packed rows."""
    generator = torch.Generator().manual_seed(1234)
    token_states = torch.randn(4, 7, 6, generator=generator, dtype=torch.float64)
    attention_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7, [0, 0, 0, 1, 1, 1, 1], [1] * 7])
    position_ids = torch.tensor(
        [[0, 0, 0, 1, 2, 3, 4], list(range(7)), [0, 0, 0, 0, 1, 2, 3], [0, 1, 2, 0, 1, 2, 3]]
    )
    mask = attention_mask.bool()
    uniforms = torch.rand(4, 7, generator=generator, dtype=torch.float64)
    return token_states, mask, document_starts(mask, position_ids), uniforms


def build_router() -> torch.nn.ModuleDict:
    """Query and key projections (6 → 5), float64, identical on every rank."""
    generator = torch.Generator().manual_seed(99)
    router = torch.nn.ModuleDict(
        {name: torch.nn.Linear(6, 5, bias=False, dtype=torch.float64) for name in ("query", "key")}
    )
    with torch.no_grad():
        for projection in router.values():
            projection.weight.copy_(torch.randn(5, 6, generator=generator, dtype=torch.float64))
    return router


def router_ratio_loss(
    router: torch.nn.ModuleDict,
    problem: tuple[torch.Tensor, ...],
    scope: str,
    accumulator: RatioAccumulator | None = None,
) -> RatioLossOutput:
    """Cosine probabilities, sharpened Bernoulli decisions from the fixed uniforms, ratio loss."""
    token_states, mask, starts, uniforms = problem
    probs = cosine_boundary_probs(router["query"](token_states), router["key"](token_states), starts, mask)
    boundaries = boundary_decisions_from_noise(
        probs, starts, mask, uniforms, noise="bernoulli", training=True, tau=6.0
    )
    return ratio_loss(
        probs, boundaries, mask, target_ratio=TARGET_RATIO, scope=scope, accumulator=accumulator
    )


def _gradients(router: torch.nn.ModuleDict) -> dict[str, torch.Tensor]:
    return {name: parameter.grad.clone() for name, parameter in router.named_parameters()}


def _statistics(out: RatioLossOutput, prefix: str) -> dict[str, torch.Tensor]:
    return {
        f"{prefix}_boundary_fraction": out.boundary_fraction,
        f"{prefix}_mean_prob": out.mean_prob,
        f"{prefix}_value": out.value,
        f"{prefix}_token_count": out.token_count,
    }


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    local = tuple(tensor[2 * rank : 2 * rank + 2] for tensor in build_problem())
    router = build_router()
    result: dict[str, torch.Tensor] = {}

    out = router_ratio_loss(router, local, scope="global")
    out.loss.backward()
    result.update(_statistics(out, "global"))
    local_grads = _gradients(router)
    for name, grad in local_grads.items():
        result[f"local_grad.{name}"] = grad
        reduced = grad.clone()
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
        result[f"reduced_grad.{name}"] = reduced

    router.zero_grad()
    router_ratio_loss(router, local, scope="batch").loss.backward()
    result.update({f"batch_grad.{name}": grad for name, grad in _gradients(router).items()})

    # Two micro-batches of one row each; the step's token count is known up front, as in Trainer.
    step_tokens = local[1].sum().to(torch.float64)
    dist.all_reduce(step_tokens, op=dist.ReduceOp.SUM)
    accumulator = RatioAccumulator(num_micro_batches=2)
    accumulator.reset(step_token_count=step_tokens)
    for row in range(2):
        micro_batch = tuple(tensor[row : row + 1] for tensor in local)
        accumulated = router_ratio_loss(router, micro_batch, scope="global", accumulator=accumulator)
    result.update(_statistics(accumulated, "accumulated"))

    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
