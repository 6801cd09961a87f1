"""Keeps benchmarks/reproduce_conceptmoe.py from rotting: the compute matching picks the top-k the
calculator says, and `--quick` (one seed, a few steps, two workers) runs every configuration and the CT
conversion, printing each table with finite figures and a JSON record of every run."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "reproduce_conceptmoe.py"
TITLES = ("[compute]", "[§4.5]", "[§4.3]", "[directions]", "total wall time")


def load_script():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("reproduce_conceptmoe", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_matched_top_k_is_the_one_nearest_the_source_flops():
    from hf_concept.compute import conceptmoe_compute
    from hf_concept.modeling.configuration_conceptmoe import ConceptMoEConfig

    script = load_script()
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
    assert [run["config"] for run in scratch] == list(load_script().SCRATCH)
    for run in scratch:
        assert len(run["history"]) == figures["args"]["steps"]
        assert all(math.isfinite(value) and value > 0 for value in run["heldout"].values()), run["heldout"]
    (ct,) = [run for run in figures["runs"] if run["part"] == "ct"]
    names = [model["name"] for model in ct["models"]]
    assert names == ["source continued", "converted R=1.5", "converted R=2"]
    for model in ct["models"]:
        assert len(model["history"]) == figures["args"]["continue_steps"]
        assert math.isfinite(model["heldout"]["loss"]) and math.isfinite(model["converted"]["loss"])
    assert len(figures["directions"]) == 8


def test_the_checkpointable_trainer_takes_the_shared_loops_steps():
    """`trainer` holds the optimizer and schedule that `runner.accumulated_steps` keeps inside (so that a
    sweep can checkpoint them): the same batches give the same losses and weights to the last bit."""
    import random

    import torch

    script = load_script()
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
    import signal
    import time

    plain = tmp_path / "plain.json"
    command = [sys.executable, str(SCRIPT), "--quick", "--workers", "1"]
    assert subprocess.run([*command, "--json", str(plain)], capture_output=True, timeout=300).returncode == 0
    folder = tmp_path / "sweep"
    swept = [*command, "--sweep-dir", str(folder), "--checkpoint-minutes", "0"]
    process = subprocess.Popen(swept, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while (
        not list(folder.glob("checkpoints/*.json")) and process.poll() is None and time.monotonic() < deadline
    ):
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL
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
