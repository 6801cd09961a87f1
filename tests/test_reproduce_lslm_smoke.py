"""Keeps benchmarks/reproduce_lslm.py from rotting: `--quick` trains the three models (one seed, a few
steps) in a subprocess and prints every table with finite figures, and its JSON holds them per seed."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "reproduce_lslm.py"
MODELS = ("gpt2", "lslm", "dtp")
LANGUAGES = ("en", "zh", "ja")
TITLES = (
    "[models]",
    "[held-out bits per byte]",
    "[held-out bits per character]",
    "[paired differences, bits per byte]",
    "[boundary rate: training",
    "[held-out segmentation]",
    "[held-out examples, seed 0]",
    "[wall time]",
    "[directions]",
)


def numbers(value):
    """Every int or float inside a JSON value."""
    if isinstance(value, dict):
        for item in value.values():
            yield from numbers(item)
    elif isinstance(value, list):
        for item in value:
            yield from numbers(item)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        yield value


@pytest.mark.slow
def test_quick_run_prints_every_table_with_finite_figures(tmp_path):
    figures_path = tmp_path / "figures.json"
    command = [sys.executable, str(SCRIPT), "--quick", "--threads", "1", "--json", str(figures_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=90, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    printed = result.stdout
    for title in TITLES:
        assert printed.count(title) == 1, title
    assert not re.search(r"\b(nan|inf)\b", printed, re.IGNORECASE), printed
    # Every score row: one "mean ± std" cell per language, for each model.
    for title in ("[held-out bits per byte]", "[held-out bits per character]"):
        table = printed.split(title)[1].split("\n\n")[0]
        for name in MODELS:
            row = next(line for line in table.splitlines() if line.startswith(name))
            assert len(re.findall(r"\d+\.\d+ ± \d+\.\d+", row)) == len(LANGUAGES), row
    for name in ("lslm", "dtp"):
        for language in LANGUAGES:
            assert re.search(rf"^{name}\s+{language}(\s+\d+\.\d+ ± \d+\.\d+){{6}}$", printed, re.M), (
                name,
                language,
            )
            assert re.search(rf"^{name}\s+{language}: .*\|", printed, re.M), (name, language)
    figures = json.loads(figures_path.read_text(encoding="utf-8"))
    assert all(math.isfinite(value) for value in numbers(figures))
    assert figures["seeds"] == [0] and [run["model"] for run in figures["runs"]] == list(MODELS)
    counts = figures["parameters"]
    assert max(counts.values()) <= 1.05 * min(counts.values())
    for run in figures["runs"]:
        assert set(run["bits_per_byte"]) == set(LANGUAGES) and run["train_seconds"] > 0
        if run["model"] != "gpt2":
            assert 0 < run["train_rates"]["boundary_rate"] <= 1
            for cell in run["heldout"]["languages"].values():
                assert (
                    0 <= cell["precision"] <= 1
                    and 0 <= cell["recall"] <= 1
                    and cell["bytes_per_segment"] >= 1
                )
