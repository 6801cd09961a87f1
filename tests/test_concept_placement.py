"""benchmarks/concept_placement.py: each placement does what it says, and the checkpoint is left as found."""

from __future__ import annotations

import pytest
import torch

from tests.benchmark_scripts import load_benchmark


def _capped_reference(opens: list[bool], real: list[bool], cap: int) -> list[bool]:
    """One row, token by token: open where the router does, or where `cap` real tokens passed without."""
    out, run = [], 0
    for is_open, is_real in zip(opens, real, strict=True):
        forced = is_real and run >= cap
        out.append(is_open or forced)
        if is_real:
            run = 1 if (is_open or forced) else run + 1
    return out


def test_capped_matches_a_token_by_token_reference():
    script = load_benchmark("concept_placement")
    generator = torch.Generator().manual_seed(0)
    opens = torch.rand(6, 40, generator=generator) < 0.15
    mask = torch.rand(6, 40, generator=generator) < 0.8
    opens &= mask
    for cap in (1, 2, 3, 5):
        result = script.capped(opens, mask, cap)
        for row in range(opens.shape[0]):
            expected = _capped_reference(opens[row].tolist(), mask[row].tolist(), cap)
            assert result[row].tolist() == expected, (cap, row)


def test_modes_parse_and_bad_ones_are_refused(capsys):
    script = load_benchmark("concept_placement")
    assert script.parse_mode("own-cap:3") == ("own-cap", 3)
    assert script.parse_mode("depth") == ("depth", 0)
    for bad in ("own-cap:0", "own-cap", "gold"):
        with pytest.raises(SystemExit):
            script.parse_args(["--quick", "--modes", f"own,{bad}"])
        assert "--modes: mode" in capsys.readouterr().err


def test_quick_placements_realise_their_ratio_and_restore_the_model():
    script = load_benchmark("concept_placement")
    results = script.main(["--quick", "--modes", "own,fixed,own-cap:1,random,surprisal,entropy,depth,own"])
    rows = {row["mode"]: row for row in results[1:-1]}
    assert rows["fixed"]["tokens_per_concept"] == pytest.approx(2.0, abs=0.05)
    # A cap of one token opens a concept at every token.
    assert rows["own-cap:1"]["tokens_per_concept"] == 1.0
    for mode in ("random", "surprisal", "entropy", "depth"):
        assert rows[mode]["tokens_per_concept"] > 1.0, mode
    # Every placement was undone: "own" scored after all the others equals "own" scored first.
    first, last = results[0], results[-1]
    assert (first["bits_per_byte"], first["cells"]) == (last["bits_per_byte"], last["cells"])
    assert first["cell_tokens_per_concept"] == last["cell_tokens_per_concept"]
