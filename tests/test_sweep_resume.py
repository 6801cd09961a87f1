"""The sweep runner (`hf_concept.training.sweep`): a run killed with SIGKILL after a checkpoint resumes to
the very weights and metrics of an uninterrupted run; a sweep folder refuses another manifest; results are
appended one run at a time and a done run is never run again; the status view counts and estimates.

The toy run draws from every RNG a training step may use (its own batch generator, torch through dropout,
Python's and numpy's global generators), so that a state left out of the checkpoint changes the result.
Run as a script (`python tests/test_sweep_resume.py DIR STEPS`), this file is the process the test kills.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy
import pytest
import torch

from hf_concept.training import sweep
from hf_concept.training.sweep import RunSpec

VOCAB, WIDTH, LENGTH, BATCH = 64, 32, 16, 8


@pytest.fixture(autouse=True)
def one_thread():
    """The killed process and the test's own runs compute with one thread alike (the count can move the
    last bits); the suite's count is restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def toy_spec(arm: str = "lambda-0.1", seed: int = 0, lr: float = 1e-2) -> RunSpec:
    return RunSpec("toy", arm, seed, dict(lr=lr, width=WIDTH))


def weights_hash(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode() + tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def toy_run(folder: Path, steps: int, spec: RunSpec | None = None, minutes: float = 0.0) -> dict:
    """One resumable toy run in sweep `folder` (built exactly as a fresh run, then resumed if it can be)."""
    spec = spec or toy_spec()
    torch.manual_seed(spec.seed)
    model = torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, WIDTH), torch.nn.Dropout(0.1), torch.nn.Linear(WIDTH, VOCAB)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.settings["lr"])
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + 0.01 * step))
    batches = random.Random(spec.seed)
    random.seed(spec.seed + 1)
    numpy.random.seed(spec.seed + 2)

    def train_step(step: int) -> dict:
        ids = torch.tensor([[batches.randrange(VOCAB) for _ in range(LENGTH)] for _ in range(BATCH)])
        # Global Python and numpy draws: a resume that forgot their states would scale differently.
        scale = 1.0 + 0.1 * random.random() + 0.1 * float(numpy.random.rand())
        logits = model(ids[:, :-1])
        loss = scale * torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        return dict(loss=loss.item())

    def finish(history: list[dict]) -> dict:
        return dict(weights=weights_hash(model), losses=[entry["loss"] for entry in history])

    stateful = dict(model=model, optimizer=optimizer, schedule=schedule, batches=batches)
    sweep.open_sweep(folder, [spec])
    return sweep.run_resumable(spec, folder, stateful, train_step, steps, finish, checkpoint_minutes=minutes)


def test_a_run_killed_after_a_checkpoint_resumes_to_the_uninterrupted_result(tmp_path):
    steps = 200
    # Checkpoints every step where the kill must land after one, otherwise only after the last step.
    expected = toy_run(tmp_path / "whole", steps, minutes=60)
    folder = tmp_path / "killed"
    process = subprocess.Popen([sys.executable, __file__, str(folder), str(steps)])
    sidecar = sweep.checkpoint_paths(folder, toy_spec())[1]
    deadline = time.monotonic() + 60
    while not sidecar.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait()
    # The kill landed mid-run: a checkpoint short of the last step and no result yet.
    assert process.returncode == -signal.SIGKILL
    assert sweep.read_results(folder) == {}
    assert 0 < json.loads(sidecar.read_text())["step"] < steps
    resumed = toy_run(folder, steps, minutes=60)
    assert resumed["weights"] == expected["weights"]
    assert resumed["losses"] == expected["losses"]
    assert not sweep.checkpoint_paths(folder, toy_spec())[0].exists()


def test_a_kill_between_the_temp_file_and_the_rename_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    expected = toy_run(tmp_path / "whole", 30)
    replace, calls = os.replace, []

    def dies_on_the_fifth_checkpoint(source, target):
        calls.append(target)
        if len(calls) == 10:  # the manifest, then two per checkpoint (.pt, then its sidecar)
            raise KeyboardInterrupt("killed")
        replace(source, target)

    monkeypatch.setattr(sweep.os, "replace", dies_on_the_fifth_checkpoint)
    with pytest.raises(KeyboardInterrupt):
        toy_run(tmp_path / "killed", 30)
    monkeypatch.setattr(sweep.os, "replace", replace)
    assert json.loads(sweep.checkpoint_paths(tmp_path / "killed", toy_spec())[1].read_text())["step"] == 4
    assert toy_run(tmp_path / "killed", 30)["weights"] == expected["weights"]


def test_a_sweep_folder_refuses_another_manifest_naming_the_field(tmp_path):
    sweep.open_sweep(tmp_path, [toy_spec(seed=0), toy_spec(seed=1)])
    sweep.open_sweep(tmp_path, [toy_spec(seed=0), toy_spec(seed=1)])
    differing = r"at runs\[1\]\.settings\.lr \(0\.01 there, 0\.003 asked\)"
    with pytest.raises(sweep.SweepError, match=differing) as error:
        sweep.open_sweep(tmp_path, [toy_spec(seed=0), toy_spec(seed=1, lr=3e-3)])
    assert "\n" not in str(error.value) and str(tmp_path) in str(error.value)
    with pytest.raises(sweep.SweepError, match=r"runs \(length 2 there, 3 asked\)"):
        sweep.open_sweep(tmp_path, [toy_spec(seed=0), toy_spec(seed=1), toy_spec(seed=2)])


def test_a_sweep_folder_in_use_by_another_process_is_refused_until_it_ends(tmp_path):
    holder = (
        "import fcntl, sys, time; handle = open(sys.argv[1], 'a+'); handle.write('pid 1234 on elsewhere'); "
        "handle.flush(); fcntl.flock(handle, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", holder, str(tmp_path / sweep.LOCK)], stdout=subprocess.PIPE
    )
    assert process.stdout.readline() == b"held\n"
    with pytest.raises(sweep.SweepError, match="in use by pid 1234 on elsewhere"):
        sweep.open_sweep(tmp_path, [toy_spec()])
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert sweep.open_sweep(tmp_path, [toy_spec()])["runs"][0]["run"] == toy_spec().key


def test_results_are_appended_one_run_at_a_time_and_a_done_run_is_skipped(tmp_path):
    first = toy_run(tmp_path, 5)
    calls = []
    again = sweep.run_resumable(
        toy_spec(), tmp_path, {}, lambda step: calls.append(step) or {}, 5, lambda history: {}
    )
    assert calls == [] and again == first
    # A torn line (a kill inside an append) is cut before the next run's line goes in.
    with open(tmp_path / sweep.RESULTS, "ab") as handle:
        handle.write(b'{"run": "toy/torn')
    other = toy_spec(arm="other")
    sweep.run_resumable(
        other, tmp_path, {}, lambda step: {"loss": 1.0}, 2, lambda history: dict(n=len(history))
    )
    lines = (tmp_path / sweep.RESULTS).read_text().splitlines()
    assert [json.loads(line)["run"] for line in lines] == ["toy/lambda-0.1/seed0", "toy/other/seed0"]
    assert json.loads(lines[1])["n"] == 2


def test_run_or_resume_builds_nothing_for_a_done_run_and_runs_plainly_without_a_sweep(tmp_path):
    built = []

    def build():
        built.append(True)
        return (
            {},
            lambda step: {"loss": float(step)},
            lambda history: {"losses": [e["loss"] for e in history]},
        )

    assert sweep.run_or_resume(None, toy_spec(), build, 3) == {"losses": [0.0, 1.0, 2.0]}
    assert not (tmp_path / sweep.RESULTS).exists() and len(built) == 1
    first = sweep.run_or_resume(tmp_path, toy_spec(), build, 3)
    assert sweep.run_or_resume(tmp_path, toy_spec(), build, 3) == first and len(built) == 2


def test_the_status_view_counts_runs_and_estimates_from_the_same_arm(tmp_path, capsys):
    runs = [RunSpec("f", "a", 0), RunSpec("f", "a", 1), RunSpec("f", "b", 0), RunSpec("f", "a", 2)]
    manifest = json.loads(json.dumps(sweep.manifest_of(runs)))
    results = {
        "f/a/seed0": dict(arm="a", wall_seconds=10.0, gap=0.0123),
        "f/b/seed0": dict(arm="b", wall_seconds=30.0, pretrain_gap=-0.05),
    }
    progress = {"f/a/seed1": dict(step=3, steps=10, elapsed_seconds=4.0)}
    statuses = sweep.sweep_status(manifest, results, progress)
    assert [status.state for status in statuses] == ["done", "running", "done", "left"]
    # The running run: 7 steps left at 4/3 s a step (9.3 s) is more than its arm's 10 s less 4 s spent.
    assert statuses[1].estimate == pytest.approx(28 / 3) and statuses[3].estimate == pytest.approx(10.0)
    fast = sweep.sweep_status(manifest, results, {"f/a/seed1": dict(step=8, steps=10, elapsed_seconds=2.0)})
    assert fast[1].estimate == pytest.approx(8.0)
    # Without a done run of its arm, a run is estimated from all done runs.
    (alone,) = sweep.sweep_status(sweep.manifest_of([RunSpec("f", "c", 0)]), results, {})
    assert alone.estimate == pytest.approx(20.0)
    text = sweep.format_status(statuses)
    assert "2 done, 1 running, 1 left" in text and "0.3 min" in text and "step 3/10" in text
    # A done run shows its held-out − training gap where its record has one.
    assert "10.0 s, gap +0.0123" in text and "30.0 s, gap -0.0500" in text
    # The CLI reads the same from a folder.
    toy_run(tmp_path, 3)
    assert sweep.main([str(tmp_path)]) == 0
    assert "done     toy/lambda-0.1/seed0" in capsys.readouterr().out
    assert sweep.main([str(tmp_path / "missing")]) == 2


if __name__ == "__main__":
    torch.set_num_threads(1)
    toy_run(Path(sys.argv[1]), int(sys.argv[2]))


def test_a_sweep_dir_that_is_a_file_is_one_line_and_left_alone(tmp_path, capsys):
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    with pytest.raises(sweep.SweepError, match="is a file, not a folder") as error:
        sweep.open_sweep(target, [toy_spec(seed=0)])
    assert "\n" not in str(error.value) and str(target) in str(error.value)
    with pytest.raises(sweep.SweepError, match="is a file, not a folder"):
        sweep.read_status(target)
    args = argparse.Namespace(status=False, sweep_dir=str(target))
    with pytest.raises(SystemExit) as exit_info:
        sweep.open_sweep_or_exit(args, lambda: [toy_spec(seed=0)])
    assert exit_info.value.code == 2 and str(target) in capsys.readouterr().err
    assert target.read_text() == "mine" and sorted(tmp_path.iterdir()) == [target]
