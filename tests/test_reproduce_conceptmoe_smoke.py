"""Keeps benchmarks/reproduce_conceptmoe.py from rotting: the compute matching picks the top-k the
calculator says, and `--quick` (one seed, a few steps, two workers) runs every configuration and the CT
conversion, printing each table with finite figures and a JSON record of every run."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmark_scripts import load_benchmark
from tests.sweeps import kill_at_first_checkpoint

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "reproduce_conceptmoe.py"
TITLES = ("[compute]", "[§4.5]", "[§4.3]", "[directions]", "total wall time")


def test_the_matched_top_k_is_the_one_nearest_the_source_flops():
    from hf_concept.compute import conceptmoe_compute
    from hf_concept.modeling.configuration_conceptmoe import ConceptMoEConfig

    script = load_benchmark("reproduce_conceptmoe")
    args = script.parse_args([])
    fields = dict(script.backbone(args, 3072, 0), encoder_layers=2, decoder_layers=2, compression_ratio=2.0)
    top_k, ratio = script.matched_top_k(fields, args.context)
    ratios = {}
    for candidate in range(script.TOP_K, script.NUM_EXPERTS + 1):
        report, source = conceptmoe_compute(
            ConceptMoEConfig(**fields, concept_num_experts_per_tok=candidate), 256
        )
        ratios[candidate] = report.matmul_flops / source.matmul_flops
    assert ratio == ratios[top_k] and abs(ratio - 1) == min(abs(value - 1) for value in ratios.values())
    # Half the concept-layer work saved at R = 2 is given back by about twice the source's top-k.
    assert top_k > script.TOP_K
    # An ablation keeps the dynamic model's top-k; fixed chunking is matched on its own.
    dynamic = script.conceptmoe_config(args, {}, 3072, 0)
    assert (
        script.conceptmoe_config(args, dict(joint_decoding_layers=0), 3072, 0).concept_top_k
        == dynamic.concept_top_k
    )


@pytest.mark.slow
def test_quick_run_prints_every_table_with_finite_figures(tmp_path):
    figures_path = tmp_path / "figures.json"
    command = [sys.executable, str(SCRIPT), "--quick", "--workers", "2", "--json", str(figures_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for title in TITLES:
        assert title in result.stdout, title
    figures = json.loads(figures_path.read_text())
    scratch = [run for run in figures["runs"] if run["part"] == "scratch"]
    assert [run["config"] for run in scratch] == list(load_benchmark("reproduce_conceptmoe").SCRATCH)
    for run in scratch:
        assert len(run["history"]) == figures["args"]["steps"]
        assert all(math.isfinite(value) and value > 0 for value in run["heldout"].values()), run["heldout"]
    (ct,) = [run for run in figures["runs"] if run["part"] == "ct"]
    names = [model["name"] for model in ct["models"]]
    assert names == ["source continued", "converted R=1.5", "converted R=2"]
    for model in ct["models"]:
        assert len(model["history"]) == figures["args"]["continue_steps"]
        assert math.isfinite(model["heldout"]["loss"]) and math.isfinite(model["converted"]["loss"])
    assert len(figures["directions"]) == 10


def test_the_checkpointable_trainer_takes_the_shared_loops_steps():
    """`trainer` holds the optimizer and schedule that `runner.accumulated_steps` keeps inside (so that a
    sweep can checkpoint them): the same batches give the same losses and weights to the last bit."""
    import random

    import torch

    script = load_benchmark("reproduce_conceptmoe")
    args = script.parse_args(["--quick"])
    # One thread, as the script's workers run: a second one on a busy machine makes steps ~10x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    rows = [
        torch.randint(0, 96, (300,), generator=torch.Generator().manual_seed(index)) for index in range(3)
    ]
    model = script.build_scratch(args, "dynamic", 0, 96, 0)
    history = script.train(model, args, 0, dict(rows=rows), 3, args.lr)
    reference = script.build_scratch(args, "dynamic", 0, 96, 0)
    rng, accumulator = random.Random(0), script.RatioAccumulator(args.accumulation)
    torch.manual_seed(0)
    reference.ratio_accumulator = accumulator

    def batches():
        for _ in range(3):
            batch = script.runner.sample_batch(rows, args.batch_size, args.context, rng)
            accumulator.reset(batch.numel())
            yield batch

    steps = script.runner.accumulated_steps(reference, batches(), 3, args.accumulation, args.lr)
    losses = [sum(output.loss.item() for _, output in outputs) for outputs in steps]
    torch.set_num_threads(threads)
    assert [entry["loss"] for entry in history] == losses
    for (name, weight), other in zip(
        model.state_dict().items(), reference.state_dict().values(), strict=True
    ):
        assert torch.equal(weight, other), name


@pytest.mark.slow
def test_a_killed_quick_sweep_resumes_to_the_figures_of_a_plain_run(tmp_path):
    """`--sweep-dir`: killed with SIGKILL after the first checkpoint (CT's pretraining), started again, the
    sweep resumes it, runs the rest, and gives every figure of a run without a sweep."""
    plain = tmp_path / "plain.json"
    command = [sys.executable, str(SCRIPT), "--quick", "--workers", "1"]
    assert subprocess.run([*command, "--json", str(plain)], capture_output=True, timeout=300).returncode == 0
    folder = tmp_path / "sweep"
    swept = [*command, "--sweep-dir", str(folder), "--checkpoint-minutes", "0"]
    kill_at_first_checkpoint(swept, folder, timeout=300)
    # Killed in CT's pretraining (the first run with one worker), at a checkpoint short of its end.
    assert not (folder / "results.jsonl").exists()
    status = subprocess.run([*swept, "--status"], capture_output=True, text=True, timeout=120)
    assert "running  conceptmoe/" in status.stdout and " left" in status.stdout
    resumed = tmp_path / "resumed.json"
    assert subprocess.run([*swept, "--json", str(resumed)], capture_output=True, timeout=300).returncode == 0
    timing = ("seconds", "wall_seconds", "train_seconds", "run", "family", "arm")

    def figures(path):
        return [
            {k: v for k, v in run.items() if k not in timing} for run in json.loads(path.read_text())["runs"]
        ]

    assert figures(resumed) == figures(plain)
    assert len((folder / "results.jsonl").read_text().splitlines()) == 4 + 7


def test_arms_are_checked_and_a_sweep_of_other_arms_is_refused(tmp_path, capsys):
    """`--arms`: an unknown name exits 2 naming it and the valid arms; the default is every arm; the
    sweep's manifest lists the arms' runs, so a sweep started with other arms is refused."""
    script = load_benchmark("reproduce_conceptmoe")
    with pytest.raises(SystemExit) as exited:
        script.parse_args(["--arms", "dynamic,chunky"])
    assert exited.value.code == 2
    message = capsys.readouterr().err
    assert "'chunky'" in message and "no-chunk, dynamic, fixed" in message and ", ct" in message
    assert script.parse_args([]).arms == (*script.SCRATCH, "ct")
    # The arms' own order, whatever the order asked.
    args = script.parse_args(["--arms", "ct,dynamic,no-chunk", "--sweep-dir", str(tmp_path)])
    assert args.arms == ("no-chunk", "dynamic", "ct")
    runs = script.sweep_specs(args)
    assert {run.arm for run in runs} == {"no-chunk", "dynamic", *script.CT_ARMS}
    script.sweep.open_sweep(tmp_path, runs)
    other = script.parse_args(["--arms", "no-chunk,fixed,ct", "--sweep-dir", str(tmp_path)])
    with pytest.raises(script.sweep.SweepError, match="dynamic"):
        script.sweep.open_sweep(tmp_path, script.sweep_specs(other))


def test_directions_that_need_an_arm_not_run_are_not_run():
    report = load_benchmark("conceptmoe_report")
    figures = {seed: dict(loss=5.0 + seed, train_loss=4.0, inference_ratio=2.0) for seed in (0, 1)}
    scratch = {
        "no-chunk": figures,
        "dynamic": {seed: dict(entry, loss=4.5 + 1.01 * seed) for seed, entry in figures.items()},
    }
    verdict = report.directions(scratch, {})
    # Paired by seed: -0.5 and -0.49, well beyond 2 std.
    assert verdict["dynamic < no-chunk (held-out loss)"] == "reproduced"
    assert {key for key, value in verdict.items() if value is None} == set(verdict) - {
        "dynamic < no-chunk (held-out loss)"
    }


@pytest.mark.slow
def test_a_quick_run_of_some_arms_runs_those_only_and_says_what_was_not_run(capsys):
    import torch

    threads = torch.get_num_threads()
    try:
        figures = load_benchmark("reproduce_conceptmoe").main(
            ["--quick", "--workers", "1", "--arms", "dynamic,fixed"]
        )
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert figures["arms"] == ["dynamic", "fixed"]
    assert [(run["part"], run.get("config")) for run in figures["runs"]] == [
        ("scratch", "dynamic"),
        ("scratch", "fixed"),
    ]
    rows = {line.split()[0]: line for line in printed.splitlines() if line.strip()}
    for name in ("no-chunk", "linear-router", "lambda-0.1", "source"):
        assert rows[name].rstrip().endswith("not run"), rows[name]
    # No baseline: the paired differences say so; no direction is judged without its arms.
    assert rows["dynamic"].count("not run") == 2
    assert "dynamic < no-chunk (held-out loss): not run" in printed
    assert figures["directions"] == {}
