"""Keeps benchmarks/reproduce_dlcm.py from rotting: `--quick` trains the three configurations (one seed, a
few steps) in a subprocess and prints every table with finite figures, its JSON holds the per-seed figures
and curves, and the content types cover the corpus."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmark_scripts import load_benchmark
from tests.sweeps import kill_at_first_checkpoint

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "reproduce_dlcm.py"
TITLES = ("[Figure 8]", "[Table 4]", "[§8.3]", "[directions]", "total wall time")


def test_every_content_type_has_train_and_heldout_text():
    from hf_concept.data.corpus import corpus_documents

    script = load_benchmark("reproduce_dlcm")
    for split in ("train", "validation"):
        kinds = {script.content_type(name) for name, _ in corpus_documents(split)}
        assert kinds == set(script.CONTENT_TYPES), (split, kinds)
    assert script.content_type("python_programs_a.txt") == "code"
    assert script.content_type("essays_en.txt") == "prose" and script.content_type("zh.txt") == "zh"


@pytest.mark.slow
def test_quick_run_prints_every_table_with_finite_figures(tmp_path):
    figures_path, picture = tmp_path / "figures.json", tmp_path / "figure8.png"
    command = [sys.executable, str(SCRIPT), "--quick", "--threads", "1", "--json", str(figures_path)]
    result = subprocess.run([*command, "--png", str(picture)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    for title in TITLES:
        assert title in result.stdout, title
    figures = json.loads(figures_path.read_text())
    runs = figures["runs"]
    assert [run["config"] for run in runs] == ["learned-global", "rule-global", "learned-normal"]
    for run in runs:
        assert len(run["history"]) == figures["args"]["steps"]
        heldout = run["heldout"]
        values = [heldout["loss"], heldout["inference_ratio"], heldout["sampled_ratio"]]
        values += list(heldout["concept_length"].values()) + list(heldout["loss_by_type"].values())
        assert all(math.isfinite(value) and value > 0 for value in values), heldout
        assert set(run["curve"]["inference_ratio"]) == {"0.1", "0.25", "0.5", "0.75", "1"}
    assert len(figures["directions"]) == 5
    if importlib.util.find_spec("matplotlib") is not None:
        assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and figures["png"] == str(picture)
    else:
        assert "matplotlib is not installed" in result.stdout and figures["png"] is None


@pytest.mark.slow
def test_a_killed_quick_sweep_resumes_to_the_figures_of_a_plain_run(tmp_path):
    """`--sweep-dir`: killed with SIGKILL after the first checkpoint, started again, the sweep resumes
    and gives every figure of a run without a sweep; `--status` shows the run in between."""
    command = [sys.executable, str(SCRIPT), "--quick", "--threads", "1"]
    plain = tmp_path / "plain.json"
    assert subprocess.run([*command, "--json", str(plain)], capture_output=True, timeout=120).returncode == 0
    folder = tmp_path / "sweep"
    swept = [*command, "--sweep-dir", str(folder), "--checkpoint-minutes", "0"]
    kill_at_first_checkpoint(swept, folder, timeout=120)
    status = subprocess.run([*swept, "--status"], capture_output=True, text=True, timeout=120)
    assert (
        "running  dlcm/learned-global/seed0" in status.stdout and "0 done, 1 running, 2 left" in status.stdout
    )
    resumed = tmp_path / "resumed.json"
    assert subprocess.run([*swept, "--json", str(resumed)], capture_output=True, timeout=120).returncode == 0
    timing = ("train_seconds", "eval_seconds", "wall_seconds", "run", "family", "arm")

    def figures(path):
        return [
            {k: v for k, v in run.items() if k not in timing} for run in json.loads(path.read_text())["runs"]
        ]

    assert figures(resumed) == figures(plain)
    assert len((folder / "results.jsonl").read_text().splitlines()) == 3
