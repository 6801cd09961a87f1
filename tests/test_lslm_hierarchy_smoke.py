"""Keeps benchmarks/lslm_hierarchy.py from rotting: a --quick run of its arms, the swapped evaluation
segmentations, the restored config and the resume."""

from __future__ import annotations

import json

import pytest

from tests.benchmark_scripts import load_benchmark


def test_quick_run_pairs_the_arms_scores_swapped_ends_and_resumes(tmp_path, monkeypatch):
    script = load_benchmark("lslm_hierarchy")
    out = tmp_path / "hierarchy.json"
    arms = "byte,every,router,router+nxt"
    result = script.main(["--quick", "--arms", arms, "--json", str(out)])
    by_arm = {run["arm"]: run for run in result["runs"]}
    assert set(by_arm) == set(arms.split(","))
    for arm in ("every", "router", "router+nxt"):
        expected = by_arm[arm]["bits_per_byte"]["zh"] - by_arm["byte"]["bits_per_byte"]["zh"]
        assert result["differences"][arm]["zh"] == [pytest.approx(expected)]
    term = by_arm["router+nxt"]["bits_per_byte"]["en"] - by_arm["router"]["bits_per_byte"]["en"]
    assert result["segment_end_term"]["router"]["en"] == [pytest.approx(term)]
    # "every" scored under every byte's ends is itself; the router's random ends run at its own rate.
    swapped = by_arm["every"]["eval_segmentations"]
    assert swapped["scores"]["every"] == swapped["scores"]["own"]
    router = by_arm["router"]["eval_segmentations"]
    assert router["random_rate"] == router["own_rate"] == by_arm["router"]["heldout"]["pooled_rate"]
    assert router["scores"]["random"] != router["scores"]["own"]
    assert set(result["verdicts"]) == {
        "every_within_band",
        "router_within_band_zh_ja",
        "router_own_beats_random",
    }
    assert json.loads(out.read_text())["runs"] == json.loads(json.dumps(result["runs"]))

    def refuse(*_):
        raise AssertionError("a run already in --json ran again")

    monkeypatch.setattr(script, "run_arm", refuse)
    again = script.main(["--quick", "--arms", arms, "--json", str(out)])
    assert again["differences"] == result["differences"]


def test_eval_segmentation_restores_the_config_even_on_error():
    script = load_benchmark("lslm_hierarchy")
    args = script.parse_args(["--quick"])
    model, _ = script.build(args, "router", 0)
    before = model.config.to_dict()
    with pytest.raises(RuntimeError), script.lslm_rows.eval_segmentation(model, "random", 0.25) as swapped:
        assert swapped.config.boundary_source == "random" and swapped.config.beta_prior() == (0.25, 0.75)
        raise RuntimeError
    assert model.config.to_dict() == before


def test_arms_must_include_the_byte_decoder():
    script = load_benchmark("lslm_hierarchy")
    with pytest.raises(SystemExit):
        script.parse_args(["--arms", "every"])


def test_band_verdicts_read_languages_and_corpus_cells_alike():
    rows = load_benchmark("lslm_rows")
    # Means: every +0.05 / +0.15 (zh over the band); router over it in en only; own ends 0.05-0.07 better.
    every = {"en/prose": [0.05, 0.05], "zh/prose": [0.1, 0.2]}
    router = {"en/prose": [0.5, 0.5], "zh/prose": [0.2, 0.3], "ja": [0.3, 0.3]}
    own = {"en/prose": [-0.06, -0.07], "ja": [-0.06, -0.05]}
    assert rows.band_verdicts(every, router, own) == {
        "every_within_band": False,
        "router_within_band_zh_ja": True,
        "router_own_beats_random": True,
    }
    assert rows.band_verdicts(None, None, {"ja": [-0.06, -0.04]}) == {"router_own_beats_random": False}
