"""Keeps benchmarks/lslm_schedule.py from rotting: a --quick run of its three arms, and its resume."""

from __future__ import annotations

import json

import pytest

from tests.benchmark_scripts import load_benchmark


def test_quick_run_pairs_the_arms_and_resumes_from_its_json(tmp_path, monkeypatch):
    script = load_benchmark("lslm_schedule")
    out = tmp_path / "schedule.json"
    result = script.main(["--quick", "--json", str(out)])
    by_arm = {run["arm"]: run for run in result["runs"]}
    assert set(by_arm) == set(script.ARMS)
    # Joint updates give the generator every step; k = 1 half of them, over twice the steps all of them.
    assert [by_arm[arm]["generator_updates"] for arm in script.ARMS] == [4, 2, 4]
    assert [by_arm[arm]["steps"] for arm in script.ARMS] == [4, 4, 8]
    for arm in ("interleaved", "interleaved-matched"):
        expected = by_arm[arm]["bits_per_byte"]["en"] - by_arm["joint"]["bits_per_byte"]["en"]
        assert result["differences"][arm]["en"] == [pytest.approx(expected)]
    assert json.loads(out.read_text())["runs"] == json.loads(json.dumps(result["runs"]))

    def refuse(*_):
        raise AssertionError("a run already in --json ran again")

    monkeypatch.setattr(script, "run_arm", refuse)
    again = script.main(["--quick", "--json", str(out)])
    assert again["differences"] == result["differences"]


def test_arms_must_include_the_joint_baseline():
    script = load_benchmark("lslm_schedule")
    with pytest.raises(SystemExit):
        script.parse_args(["--arms", "interleaved"])
