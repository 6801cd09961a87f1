"""Coordinate check of DLCM's decoupled μP: five AdamW steps at widths 64–512 (d_concept = 2·d_token).

Under μP the per-layer activation change stays within a factor 2 across widths; under standard
parametrisation at the same learning rate it grows with width (benchmarks/coord_check_dlcm.py, run on
a smaller sequence and batch so that the whole check takes a few seconds)."""

from __future__ import annotations

import pytest

from tests.benchmark_scripts import load_benchmark

QUICK = "--widths 64,128,256,512 --lr 3e-3 --steps 5 --layers 1,1,1 --seq-len 32 --batch 2 --vocab 128"


@pytest.fixture(scope="module")
def result():
    return load_benchmark("coord_check_dlcm").main(QUICK.split())


def test_every_stage_and_the_logits_are_measured_at_every_width(result):
    expected = {"encoder.0", "concept.0", "decoder.0", "logits"}
    for table in (result.mup, result.sp):
        assert set(table) == expected
        for by_width in table.values():
            assert sorted(by_width) == [64, 128, 256, 512]
            assert all(change > 0 for change, _ in by_width.values()), "training did not move a layer"


def test_mup_keeps_every_layer_within_a_factor_two_across_widths(result):
    for name, by_width in result.mup.items():
        changes = [change for change, _ in by_width.values()]
        assert max(changes) <= 2 * min(changes), f"{name}: {by_width}"


def test_standard_parametrisation_grows_with_width(result):
    spreads = {
        name: max(c for c, _ in w.values()) / min(c for c, _ in w.values()) for name, w in result.sp.items()
    }
    assert max(spreads.values()) > 2, spreads
    # The growth is monotone in width for the hidden layers (Adam's update is ~η per entry, so a hidden
    # matrix's output change grows with its fan-in), not a fluctuation of one width.
    for name in ("encoder.0", "concept.0", "decoder.0"):
        changes = [result.sp[name][width][0] for width in (64, 128, 256, 512)]
        assert changes == sorted(changes), f"{name}: {changes}"
    assert result.passed
