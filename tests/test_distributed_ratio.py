"""The "global" ratio-loss scope: a real 2-process run (torchrun, gloo, CPU) against one process on the
concatenated batch, and accumulated micro-batches of one optimizer step in one process."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_concept.modeling.packing import document_starts
from hf_concept.modeling.routing import (
    RatioAccumulator,
    boundary_decisions_from_noise,
    linear_boundary_probs,
    ratio_loss,
    ratio_loss_coefficients,
)
from tests.workers.ratio_worker import build_problem, build_router, router_ratio_loss

WORKER = Path(__file__).parent / "workers" / "ratio_worker.py"
STATISTICS = ("boundary_fraction", "mean_prob", "value")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("ratio_ranks")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2"]
    address = ["--master_addr", "127.0.0.1", "--master_port", str(_free_port())]
    command = [*launcher, *address, str(WORKER), str(out_dir)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    completed = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=True) for rank in range(2)]


@pytest.fixture(scope="module")
def single_process():
    """F, G, value, token count and gradients of the global batch computed in one process."""
    router = build_router()
    out = router_ratio_loss(router, build_problem(), scope="batch")
    out.loss.backward()
    grads = {name: parameter.grad.clone() for name, parameter in router.named_parameters()}
    return out, grads


def test_every_rank_sees_the_global_statistics(rank_results, single_process):
    out, _ = single_process
    for result in rank_results:
        for field in STATISTICS:
            torch.testing.assert_close(result[f"global_{field}"], getattr(out, field), rtol=0, atol=1e-6)
        assert result["global_token_count"].item() == out.token_count.item()
    # The halves differ in size, so each rank alone would see other statistics.
    local_counts = [int(mask.sum()) for mask in build_problem()[1].split(2)]
    assert local_counts[0] != local_counts[1]


def test_summed_rank_gradients_equal_the_single_process_gradient(rank_results, single_process):
    _, grads = single_process
    for name, grad in grads.items():
        summed = rank_results[0][f"local_grad.{name}"] + rank_results[1][f"local_grad.{name}"]
        torch.testing.assert_close(summed, grad, rtol=0, atol=1e-6)
        torch.testing.assert_close(rank_results[0][f"reduced_grad.{name}"], grad, rtol=0, atol=1e-6)
        assert torch.equal(rank_results[0][f"reduced_grad.{name}"], rank_results[1][f"reduced_grad.{name}"])
        # Averaging per-rank batch-scope losses (what DDP does with a local loss) is another gradient.
        per_rank_mean = (rank_results[0][f"batch_grad.{name}"] + rank_results[1][f"batch_grad.{name}"]) / 2
        assert (per_rank_mean - grad).abs().max() > 1e-4


def test_accumulated_micro_batches_across_ranks_end_at_the_step_statistics(rank_results, single_process):
    out, _ = single_process
    for result in rank_results:
        for field in STATISTICS:
            torch.testing.assert_close(result[f"accumulated_{field}"], getattr(out, field), rtol=0, atol=1e-6)
        assert result["accumulated_token_count"].item() == out.token_count.item()


def micro_batch_routing(seed, rows, attention_mask=None):
    """A float64 leaf of probabilities over `rows` rows of 6 tokens, and sampled decisions."""
    generator = torch.Generator().manual_seed(seed)
    if attention_mask is None:
        attention_mask = torch.ones(rows, 6, dtype=torch.long)
    mask = attention_mask.bool()
    starts = document_starts(mask)
    logits = torch.randn(rows, 6, generator=generator, dtype=torch.float64)
    probs = linear_boundary_probs(logits, starts, mask).detach().requires_grad_(True)
    uniforms = torch.rand(rows, 6, generator=generator, dtype=torch.float64)
    boundaries = boundary_decisions_from_noise(
        probs, starts, mask, uniforms, noise="bernoulli", training=True
    )
    return probs, boundaries, mask


def run_step(micro_batches, accumulator):
    outputs, grads = [], []
    for probs, boundaries, mask in micro_batches:
        out = ratio_loss(probs, boundaries, mask, target_ratio=3.0, scope="global", accumulator=accumulator)
        outputs.append(out)
        grads.append(torch.autograd.grad(out.loss, probs)[0])
    return outputs, grads


def concatenated(micro_batches):
    return [torch.cat([micro_batch[index] for micro_batch in micro_batches]) for index in range(3)]


def test_accumulator_ends_at_the_step_statistics_with_exact_token_weights():
    micro_batches = [
        micro_batch_routing(0, 2, torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])),
        micro_batch_routing(1, 3, torch.tensor([[1] * 6, [0, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1]])),
    ]
    probs, boundaries, mask = concatenated(micro_batches)
    full = ratio_loss(probs, boundaries, mask, target_ratio=3.0, scope="batch")
    accumulator = RatioAccumulator(num_micro_batches=2)
    accumulator.reset(step_token_count=int(mask.sum()))
    outputs, grads = run_step(micro_batches, accumulator)

    for field in ("boundary_fraction", "mean_prob", "value", "token_count"):
        torch.testing.assert_close(getattr(outputs[-1], field), getattr(full, field), rtol=0, atol=1e-12)
    # The first micro-batch only knew its own boundaries.
    _, first_boundaries, first_mask = micro_batches[0]
    first_fraction = (first_boundaries & first_mask).sum() / first_mask.sum()
    torch.testing.assert_close(outputs[0].boundary_fraction, first_fraction.double(), rtol=0, atol=1e-12)
    assert (outputs[0].boundary_fraction - full.boundary_fraction).abs() > 1e-3
    # Weight of each token's p in G: gradient / slope(F_i) = 1/N on real tokens, 0 on pads, as in one
    # big batch; over the step they sum to 1.
    total_weight = 0.0
    for out, grad, (_, _, micro_mask) in zip(outputs, grads, micro_batches, strict=True):
        slope, _ = ratio_loss_coefficients(out.boundary_fraction, 3.0)
        weights = grad / slope
        expected = micro_mask.double() / mask.sum()
        torch.testing.assert_close(weights, expected, rtol=0, atol=1e-12)
        total_weight = total_weight + weights.sum()
    torch.testing.assert_close(total_weight, torch.tensor(1.0, dtype=torch.float64), rtol=0, atol=1e-12)


def test_accumulated_gradient_equals_full_batch_when_running_fractions_agree():
    first = micro_batch_routing(2, 2)
    # The second micro-batch repeats the first one's rows: the running F never changes.
    second = tuple(tensor.detach().repeat(2, 1) for tensor in first)
    second[0].requires_grad_(True)
    probs, boundaries, mask = concatenated([first, second])
    full = ratio_loss(probs, boundaries, mask, target_ratio=3.0, scope="batch")
    full_grad = torch.autograd.grad(full.loss, probs)[0]
    accumulator = RatioAccumulator(num_micro_batches=2)
    accumulator.reset(step_token_count=int(mask.sum()))
    outputs, grads = run_step([first, second], accumulator)
    torch.testing.assert_close(outputs[0].loss + outputs[1].loss, full.loss, rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.cat(grads), full_grad, rtol=0, atol=1e-12)
    assert full_grad.abs().sum() > 1e-6


def test_accumulator_without_step_count_extrapolates_the_token_count():
    # Equal token counts: the estimate running·k/i is exact.
    equal = [micro_batch_routing(3, 2), micro_batch_routing(4, 2)]
    uneven = [micro_batch_routing(5, 1), micro_batch_routing(6, 3)]
    for micro_batches in (equal, uneven):
        accumulator = RatioAccumulator(num_micro_batches=2)
        outputs, grads = run_step(micro_batches, accumulator)
        running_tokens = 0
        for index, (out, grad, (_, _, micro_mask)) in enumerate(
            zip(outputs, grads, micro_batches, strict=True)
        ):
            running_tokens += int(micro_mask.sum())
            slope, _ = ratio_loss_coefficients(out.boundary_fraction, 3.0)
            estimate = running_tokens * 2 / (index + 1)
            torch.testing.assert_close(grad / slope, micro_mask.double() / estimate, rtol=0, atol=1e-12)
            if micro_batches is equal:
                torch.testing.assert_close(grad / slope, micro_mask.double() / 24, rtol=0, atol=1e-12)


def test_accumulator_demands_a_reset_between_steps():
    micro_batch = micro_batch_routing(7, 1)
    accumulator = RatioAccumulator(num_micro_batches=1)
    run_step([micro_batch], accumulator)
    with pytest.raises(ValueError, match="reset"):
        run_step([micro_batch], accumulator)
    accumulator.reset()
    (again,), _ = run_step([micro_batch], accumulator)
    single = ratio_loss(*micro_batch, target_ratio=3.0, scope="batch")
    torch.testing.assert_close(again.value, single.value, rtol=0, atol=1e-12)
    for bad in (0, 1.5):
        with pytest.raises(ValueError, match="num_micro_batches"):
            RatioAccumulator(num_micro_batches=bad)
