"""Keeps benchmarks/reproduce_lslm.py from rotting: `--quick` trains its models (one seed, a few steps) in
a subprocess and prints every table with finite figures, and its JSON holds them per seed; the byte-count
references against a plain count."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.benchmark_scripts import load_benchmark
from tests.sweeps import kill_at_first_checkpoint

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "reproduce_lslm.py"
MODELS = ("gpt2", "byte", "lslm", "dtp", "every", "random")
REFERENCES = ("unigram", "bigram")
LANGUAGES = ("en", "zh", "ja")
TITLES = (
    "[models]",
    "[held-out bits per byte (softmax over the 256 byte ids)]",
    "[held-out bits per byte (softmax over all 261 ids",
    "[held-out bits per character (byte-id softmax)]",
    "[paired differences, bits per byte]",
    "[held-out bits per byte under other evaluation segmentations]",
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
    for title in ("[held-out bits per byte (softmax over the 256", "[held-out bits per character"):
        table = printed.split(title)[1].split("\n\n")[0]
        for name in (*MODELS, *REFERENCES):
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
    assert figures["seeds"] == [0] and [run["model"] for run in figures["runs"]] == [*MODELS, *REFERENCES]
    counts = {name: count for name, count in figures["parameters"].items() if name != "byte"}
    assert max(counts.values()) <= 1.05 * min(counts.values())
    # The fair baseline is matched by width and depth: fewer parameters (no router, no cross-attention).
    assert figures["parameters"]["byte"] < figures["parameters"]["lslm"]
    for run in figures["runs"]:
        assert set(run["bits_per_byte"]) == set(LANGUAGES) and run["train_seconds"] > 0
        # Renormalised over the byte ids: never longer than the code over every id.
        assert all(
            run["bits_per_byte"][lang] <= run["bits_per_byte_all_ids"][lang] + 1e-9 for lang in LANGUAGES
        )
        if run["model"] in ("lslm", "dtp", "every", "random"):
            scores = run["eval_segmentations"]["scores"]
            assert set(scores) == {"own", "random", "every"} and scores["own"] == run["bits_per_byte"]
        if run["model"] in ("lslm", "dtp"):
            assert 0 < run["train_rates"]["boundary_rate"] <= 1
            for cell in run["heldout"]["languages"].values():
                assert (
                    0 <= cell["precision"] <= 1
                    and 0 <= cell["recall"] <= 1
                    and cell["bytes_per_segment"] >= 1
                )


@pytest.mark.parametrize("name", ["lslm", "dtp"])
def test_the_checkpointable_trainer_takes_the_shared_loops_steps(name):
    """`trainer` holds the optimizer, schedule and batch generator that `runner.train` keeps inside (so
    that a sweep can checkpoint them): the same losses, metrics and weights to the last bit."""
    script = load_benchmark("reproduce_lslm")
    args = script.parse_args(["--quick"])
    # One thread, as the script runs: a second one on a busy machine makes these steps ~10x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    shared = script.runner_args(args, 0, name)
    generator = torch.Generator().manual_seed(0)
    rows = [torch.randint(4, 260, (200,), generator=generator) for _ in range(3)]
    model = script.build_model(args, name, 0)
    groups = model.config.update_schedule if name == "lslm" else None
    _, step = script.runner.trainer(model, shared, groups, rows)
    history = [step(index) for index in range(args.steps)]
    reference, expected = script.build_model(args, name, 0), []
    train_loss = script.runner.train(reference, shared, groups, rows, expected)
    torch.set_num_threads(threads)
    assert history == expected and script.tail_loss(history) == train_loss
    for (key, weight), other in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(weight, other), key


@pytest.mark.slow
def test_a_killed_sweep_resumes_to_the_figures_of_a_plain_run(tmp_path):
    """`--sweep-dir`: killed with SIGKILL after the first checkpoint, started again, the sweep resumes
    and gives every figure of a run without a sweep; `--status` shows the run in between."""
    sizes = ["--seeds", "0", "--steps", "30", "--width", "32", "--layers", "1,1,1", "--context", "64"]
    command = [sys.executable, str(SCRIPT), *sizes, "--batch-size", "4", "--eval-bytes", "512"]
    plain = tmp_path / "plain.json"
    assert subprocess.run([*command, "--json", str(plain)], capture_output=True, timeout=300).returncode == 0
    folder = tmp_path / "sweep"
    swept = [*command, "--sweep-dir", str(folder), "--checkpoint-minutes", "0"]
    kill_at_first_checkpoint(swept, folder, timeout=120)
    status = subprocess.run([*swept, "--status"], capture_output=True, text=True, timeout=120)
    assert "running  lslm/gpt2/seed0" in status.stdout and "0 done, 1 running, 5 left" in status.stdout
    resumed = tmp_path / "resumed.json"
    assert subprocess.run([*swept, "--json", str(resumed)], capture_output=True, timeout=300).returncode == 0
    timing = ("train_seconds", "eval_seconds", "wall_seconds", "run", "family", "arm")

    def figures(path):
        return [
            {k: v for k, v in run.items() if k not in timing} for run in json.loads(path.read_text())["runs"]
        ]

    assert figures(resumed) == figures(plain)
    assert len((folder / "results.jsonl").read_text().splitlines()) == len(MODELS)


def test_count_references_are_the_plain_add_one_and_interpolated_counts():
    rows = load_benchmark("lslm_rows")
    batches = [torch.tensor([[1, 5 + 97, 5 + 98, 5 + 97], [5 + 98, 5 + 98, 2, 5 + 97]])]
    scores = rows.count_references(lambda index: batches[index], 1, {"t": "ab"})
    # Bytes seen: a ×3, b ×3 (the specials 1 and 2 are not bytes and break the bigrams: ab, ba, bb).
    p_a = p_b = (3 + 1) / (6 + 256)
    assert scores["unigram"]["t"] == pytest.approx(-(math.log2(p_a) + math.log2(p_b)) / 2)
    p_b_after_a = (1 + rows.BIGRAM_PRIOR * p_b) / (1 + rows.BIGRAM_PRIOR)
    assert scores["bigram"]["t"] == pytest.approx(-(math.log2(p_a) + math.log2(p_b_after_a)) / 2)


def test_models_names_the_rows_and_segmental_is_the_lslm_with_its_estimator(tmp_path):
    """`--models` runs the rows it names (the opt-in "segmental" among them) and refuses an unknown or a
    repeated name; "segmental" is the LSLM row with `SEGMENTAL`'s fields and nothing else changed."""
    script = load_benchmark("reproduce_lslm")
    assert script.parse_args(["--quick"]).models == script.MODELS
    assert script.parse_args(["--quick", "--models", "byte,segmental"]).models == ("byte", "segmental")
    for bad in ("byte,bogus", "byte,byte", ","):
        with pytest.raises(SystemExit):
            script.parse_args(["--quick", "--models", bad])
    args = script.parse_args(["--quick", "--models", "lslm,segmental"])
    lslm, segmental = (script.build_model(args, name, 0) for name in ("lslm", "segmental"))
    changed = {
        field
        for field, value in segmental.config.to_dict().items()
        if lslm.config.to_dict().get(field) != value
    }
    assert changed == set(script.SEGMENTAL)
    assert all(getattr(segmental.config, field) == value for field, value in script.SEGMENTAL.items())
    for weight, other in zip(lslm.state_dict().values(), segmental.state_dict().values(), strict=True):
        assert torch.equal(weight, other)
