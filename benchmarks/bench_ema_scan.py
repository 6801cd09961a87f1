"""The dechunk EMA: parallel scan (hf_concept.modeling.concept_scan) against the Python loop over concepts.

Both run in the same process on the same inputs after a warm-up, so the printed ratio (loop time / scan
time) does not depend on the machine's absolute speed. Each is timed two ways: back-to-back runs of one
function with `torch.utils.benchmark` (the usual practice: caches, allocator and worker threads warm), and
interleaved with the other, one call each in turn (the scan then starts from whatever the loop's 4,096
single-threaded steps left behind: on the 2-core VM this was written on, that slows the scan's every
kernel, tiny ones included, by about 2x). Checks first that
the two agree (outputs and gradients). The bar set by the project: the scan at least 50x faster than the
loop at 4,096 concepts, forward.

    python benchmarks/bench_ema_scan.py [--concepts 4096] [--batch 1] [--hidden 512] [--repeats 7]
                                        [--min-run-time 1.0] [--block-size 16] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.utils.benchmark as benchmark

from hf_concept.modeling.concept_scan import DEFAULT_BLOCK_SIZE, ema_scan
from hf_concept.reference.scan import ema_scan_loop


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concepts", type=int, default=4096, help="concepts per row (C)")
    parser.add_argument("--batch", type=int, default=1, help="rows (B)")
    parser.add_argument("--hidden", type=int, default=512, help="concept width (D)")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs of each when interleaved")
    parser.add_argument(
        "--min-run-time", type=float, default=1.0, help="seconds of back-to-back runs per function"
    )
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="scan block length (T)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def make_inputs(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(args.seed)
    concept_states = torch.randn(args.batch, args.concepts, args.hidden, generator=generator)
    probs = torch.rand(args.batch, args.concepts, generator=generator)
    # A packed row: a new document (p = 1) every 512 concepts.
    probs[:, ::512] = 1.0
    concept_mask = torch.ones(args.batch, args.concepts, dtype=torch.bool)
    return concept_states, probs, concept_mask


def forward_and_backward(function, concept_states, probs, concept_mask, upstream):
    states = concept_states.detach().requires_grad_(True)
    chunk_probs = probs.detach().requires_grad_(True)
    output = function(states, chunk_probs, concept_mask)
    output.backward(upstream)
    return output.detach(), states.grad, chunk_probs.grad


def timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def back_to_back(function, min_run_time: float) -> list[float]:
    """Seconds per call, from `torch.utils.benchmark` (warm-up, then blocks of calls of one function)."""
    timer = benchmark.Timer(
        stmt="function()", globals={"function": function}, num_threads=torch.get_num_threads()
    )
    return list(timer.blocked_autorange(min_run_time=min_run_time).times)


def interleaved(loop_call, scan_call, repeats: int) -> tuple[list[float], list[float]]:
    """Seconds per call, alternating the two: the scan starts from what the loop's steps left behind."""
    loop_call(), scan_call()
    loop_times, scan_times = [], []
    for _ in range(repeats):
        loop_times.append(timed(loop_call))
        scan_times.append(timed(scan_call))
    return loop_times, scan_times


def compare(name: str, loop_call, scan_call, args: argparse.Namespace) -> None:
    measured = {
        "back-to-back": (
            back_to_back(loop_call, args.min_run_time),
            back_to_back(scan_call, args.min_run_time),
        ),
        "interleaved": interleaved(loop_call, scan_call, args.repeats),
    }
    for mode, (loop_times, scan_times) in measured.items():
        loop_median, scan_median = statistics.median(loop_times), statistics.median(scan_times)
        print(
            f"{name:<17} {mode:<12}  loop {loop_median * 1e3:8.2f} ms  scan {scan_median * 1e3:7.3f} ms  "
            f"ratio loop/scan {loop_median / scan_median:6.1f}x  "
            f"(medians of {len(loop_times)} and {len(scan_times)} runs)"
        )


def forward_only(function, concept_states, probs, concept_mask):
    with torch.no_grad():
        return function(concept_states, probs, concept_mask)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    inputs = make_inputs(args)

    def scan(states, chunk_probs, mask):
        return ema_scan(states, chunk_probs, mask, block_size=args.block_size)

    upstream = torch.randn_like(inputs[0])
    torch.testing.assert_close(forward_only(scan, *inputs), forward_only(ema_scan_loop, *inputs))
    for fast, slow in zip(
        forward_and_backward(scan, *inputs, upstream),
        forward_and_backward(ema_scan_loop, *inputs, upstream),
        strict=True,
    ):
        torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-4)
    print(
        f"EMA scan, B={args.batch} C={args.concepts} D={args.hidden} block={args.block_size} "
        f"threads={torch.get_num_threads()} torch={torch.__version__}: "
        "scan and loop agree (outputs and gradients)"
    )
    compare(
        "forward", lambda: forward_only(ema_scan_loop, *inputs), lambda: forward_only(scan, *inputs), args
    )
    compare(
        "forward+backward",
        lambda: forward_and_backward(ema_scan_loop, *inputs, upstream),
        lambda: forward_and_backward(scan, *inputs, upstream),
        args,
    )


if __name__ == "__main__":
    main()
