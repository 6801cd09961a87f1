"""Keeps benchmarks/bench_dlcm.py from rotting: `--quick` runs end to end and prints every table, and the
L x M baseline it times is the same function as the replicated form (its equality check has teeth)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.benchmark_scripts import load_benchmark

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_dlcm.py"


def table_rows(printed: str, title: str) -> list[list[str]]:
    """The whitespace-split rows of the table printed after the line starting with `title`."""
    lines = printed.splitlines()
    start = next(index for index, line in enumerate(lines) if line.startswith(title))
    rows = []
    for line in lines[start + 2 :]:
        if not line.strip() or not line.split()[0].isdigit():
            break
        rows.append(line.split())
    return rows


def test_quick_run_prints_both_tables_after_the_equality_checks():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    printed = result.stdout
    for length in (64, 128):
        for ratio in (2, 4):
            assert (
                f"L={length} R={ratio}: forms agree (outputs within 1e-05, gradients within 0.0001;"
                in printed
            )
        assert f"L={length}: DLCM cached prefill and cache-less forward agree on the last logits" in printed
    attention = table_rows(printed, "[cross-attention")
    # Two ratios x two lengths, a forward and a forward+backward row each; every time and ratio positive.
    assert [(row[0], row[1], row[3]) for row in attention] == [
        (length, ratio, mode)
        for ratio in ("2", "4")
        for length in ("64", "128")
        for mode in ("fwd", "fwd+bwd")
    ]
    assert all(len(row) == 12 and all(float(cell) > 0 for cell in row[4:]) for row in attention)
    assert "target (L x M time / replicated time >= 1.3x at L=4096, R=4):" in printed
    assert "faster training form (forward+backward), library counted vs replicated, per R:" in printed
    assert "non-embedding parameters: DLCM" in printed
    model = table_rows(printed, "[whole model")
    assert [row[0] for row in model] == ["64", "128"]
    for row in model:
        # Fixed chunking gives exactly R = 4; KV bytes near the ideal from the layer shapes (the cache
        # also holds slots and per-row state, and the still-open last chunk has no concept yet).
        assert float(row[1]) == pytest.approx(4.0)
        kv_ratio, ideal = float(row[-2]), float(row[-1])
        assert kv_ratio == pytest.approx(ideal, rel=0.15)


def test_count_bias_matches_counted_positions_for_uneven_chunks():
    bench = load_benchmark("bench_dlcm")
    # Chunks of lengths 1, 3, 2, 5, 1 (slot = chunk), two rows with different splits.
    index = torch.tensor([[0, 1, 1, 1, 2, 2, 3, 3, 3, 3, 3, 4], [0, 0, 0, 0, 1, 2, 2, 2, 3, 3, 4, 4]])
    counts = torch.cumsum(F.one_hot(index, 5), dim=1).float()  # (B, L, M)
    expected = torch.where(counts > 0, counts.log(), float("-inf")).unsqueeze(1)
    torch.testing.assert_close(bench.count_bias(index, 5), expected, atol=0.0, rtol=0.0)


def test_equality_check_rejects_an_lxm_form_without_the_count_weights():
    bench = load_benchmark("bench_dlcm")
    args = bench.parse_args(["--quick"])
    inputs = bench.attention_inputs(args, 32, 4)
    scale = args.head_dim**-0.5
    forms = bench.attention_forms(inputs[4], inputs[1].shape[2])
    bench.check_forms(inputs, forms, scale)

    def unweighted(query, concept_k, concept_v, index, scale):
        # Availability mask only: every readable concept counts once, as if it were not replicated.
        allowed = torch.isfinite(bench.count_bias(index, concept_k.shape[2]))
        return F.scaled_dot_product_attention(query, concept_k, concept_v, attn_mask=allowed, scale=scale)

    forms["lxm_eager"] = unweighted
    with pytest.raises(AssertionError):
        bench.check_forms(inputs, forms, scale)
