"""Sweeps of training runs that last hours: a manifest, checkpoints, append-only results, a status view.

A sweep folder (`--sweep-dir DIR` of a reproduction script) holds:

- `manifest.json`: every run of the sweep (family, arm, seed and the arm's settings), written once when the
  sweep starts. A later start with another manifest is refused with one line naming the first field that
  differs, so that a folder never mixes the results of two setups.
- `checkpoints/<run>.pt` (and `<run>.json`, its step and time, read by the status view): the model,
  optimizer and scheduler state, the RNG states of torch, Python and numpy, the data-order state (the
  run's own batch generator), the step and the per-step records logged so far. Written every
  `checkpoint_minutes` (and after the last step) by temp file + fsync + rename: a kill at any moment leaves
  the previous checkpoint or the new one, never a torn file. A run resumed from it computes the very same
  steps as one that was never stopped (same thread count: the manifest's settings should name it).
- `.lock`: held (filelock's OS lock, `flock` on Unix) by the process running the sweep, so that a second
  start on the same folder is refused while the first lives; the kernel drops it when that process ends,
  however it ends. The file names the holder (pid and host) for the refusal.
- `results.jsonl`: one JSON line per finished run, appended with one write and fsync; a run listed there is
  never run again. Its checkpoint is removed once the line is on disk.

Nothing here knows a model: `run_resumable` takes the objects whose state must survive a kill (anything
with `state_dict`/`load_state_dict`, or a `random.Random`), a function that performs step i and returns
its record, and a function that turns the records into the run's result (evaluation). The status view,
`python -m hf_concept.training.sweep DIR`, prints each run as done / running / left with wall times and an
estimate for the rest. This lives in the package, not beside the scripts, because it is model-free and
reusable by any training loop (and tests import it like any other module).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy
import torch

from hf_concept.locking import try_lock
from hf_concept.staging import staged

MANIFEST = "manifest.json"
RESULTS = "results.jsonl"
CHECKPOINTS = "checkpoints"
LOCK = ".lock"
# Sweep folders this process holds the lock of (a lock per folder, kept until the process ends).
_HELD: dict[Path, Any] = {}
MANIFEST_FORMAT = 1


class SweepError(ValueError):
    """A sweep folder that cannot be used as asked (one line naming the file and what differs)."""


@dataclass(frozen=True)
class RunSpec:
    """One run of a sweep: `settings` are the arm's values that change its result (JSON values only)."""

    family: str
    arm: str
    seed: int
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.family}/{self.arm}/seed{self.seed}"

    @property
    def file_stem(self) -> str:
        # Arm names carry '=' and '.' at most; '/' would open folders.
        return self.key.replace("/", "--")


# ---------------------------------------------------------------------------------------------- files


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """`data` at `path`, all or nothing: a temp file beside it, fsynced, renamed over it, folder fsynced."""
    with staged(path, _temporary(Path(path)), durable=True) as temporary:
        temporary.write_bytes(data)


def atomic_write_json(path: Path, value: Any) -> None:
    atomic_write_bytes(path, (json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode())


def _temporary(path: Path) -> Path:
    # Per process: worker processes may write side by side in one sweep folder.
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def append_result(folder: Path, record: dict) -> None:
    """Append `record` as one line of `results.jsonl` (one write, flush, fsync). A torn last line left by a
    kill during an earlier append is cut off first, so that every line stays whole JSON."""
    path = Path(folder) / RESULTS
    _cut_torn_tail(path)
    line = (json.dumps(record, ensure_ascii=False) + "\n").encode()
    # O_APPEND: worker processes appending side by side never interleave within one write.
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(descriptor, line)
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _cut_torn_tail(path: Path) -> None:
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return
    with open(path, "r+b") as handle:
        handle.truncate(data.rfind(b"\n") + 1)
        os.fsync(handle.fileno())


def read_results(folder: Path) -> dict[str, dict]:
    """Run key → its result record, from `results.jsonl` (a torn last line is not a result)."""
    path = Path(folder) / RESULTS
    if not path.exists():
        return {}
    records = {}
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        if line.endswith("\n"):
            record = json.loads(line)
            records[record["run"]] = record
    return records


# ---------------------------------------------------------------------------------------------- manifest


def manifest_of(runs: Iterable[RunSpec]) -> dict:
    """The manifest of `runs`, in their order (a pure function: the same runs give the same manifest)."""
    return dict(format=MANIFEST_FORMAT, runs=[dict(asdict(run), run=run.key) for run in runs])


def first_difference(saved: Any, asked: Any, where: str = "") -> str | None:
    """The path of the first field where two JSON values differ (`runs[3].settings.lr`), or None."""
    if isinstance(saved, dict) and isinstance(asked, dict):
        for name in [*saved, *(name for name in asked if name not in saved)]:
            inner = f"{where}.{name}" if where else name
            if name not in saved or name not in asked:
                return f"{inner} (only {'there' if name in saved else 'asked'})"
            found = first_difference(saved[name], asked[name], inner)
            if found is not None:
                return found
        return None
    if isinstance(saved, list) and isinstance(asked, list):
        if len(saved) != len(asked):
            return f"{where} (length {len(saved)} there, {len(asked)} asked)"
        for index, (left, right) in enumerate(zip(saved, asked, strict=True)):
            found = first_difference(left, right, f"{where}[{index}]")
            if found is not None:
                return found
        return None
    if saved == asked:
        return None
    return f"{where or '(top level)'} ({json.dumps(saved)} there, {json.dumps(asked)} asked)"


def open_sweep(folder: Path, runs: list[RunSpec]) -> dict:
    """Create the sweep folder with the manifest of `runs`, or check an existing one against it; returns
    the manifest. Raises `SweepError` naming the first differing field of a manifest that differs."""
    folder = Path(folder)
    check_sweep_folder(folder)
    manifest = manifest_of(runs)
    # JSON round trip: tuples become lists as they are on disk.
    manifest = json.loads(json.dumps(manifest))
    path = folder / MANIFEST
    (folder / CHECKPOINTS).mkdir(parents=True, exist_ok=True)
    lock_sweep(folder)
    if path.exists():
        saved = json.loads(path.read_text(encoding="utf-8"))
        differing = first_difference(saved, manifest)
        if differing is not None:
            raise SweepError(
                f"--sweep-dir {folder}: {MANIFEST} differs from the sweep asked at {differing}; "
                "use another folder, or the settings it was started with"
            )
        return saved
    atomic_write_json(path, manifest)
    return manifest


def check_sweep_folder(folder: Path) -> None:
    """`SweepError` naming `folder` when it exists and is not a folder (nothing is written then)."""
    if folder.exists() and not folder.is_dir():
        raise SweepError(f"--sweep-dir {folder} is a file, not a folder: give a folder for the sweep")


def lock_sweep(folder: Path) -> None:
    """Hold `DIR/.lock` for the rest of this process (an OS lock, which the kernel drops when its holder
    ends, a SIGKILL included): a second process started on the same sweep is refused at once, naming the
    holder, instead of running the same runs twice. Worker processes run under their parent's lock."""
    folder = Path(folder).resolve()
    if folder in _HELD:
        return
    path = folder / LOCK
    lock = try_lock(path)
    if lock is None:
        holder = path.read_text(encoding="utf-8").strip() or "another process"
        raise SweepError(f"--sweep-dir {folder}: in use by {holder}; see its --status")
    path.write_text(f"pid {os.getpid()} on {socket.gethostname()}", encoding="utf-8")
    _HELD[folder] = lock


# ---------------------------------------------------------------------------------------------- checkpoints


def _state_of(value: Any) -> Any:
    return value.getstate() if isinstance(value, random.Random) else value.state_dict()


def _restore(value: Any, state: Any) -> None:
    if isinstance(value, random.Random):
        value.setstate(state)
    else:
        value.load_state_dict(state)


def checkpoint_paths(folder: Path, spec: RunSpec) -> tuple[Path, Path]:
    """The run's checkpoint (`.pt`) and its small status sidecar (`.json`)."""
    # Not with_suffix: an arm name such as "lambda-0.01" has a dot of its own.
    folder = Path(folder) / CHECKPOINTS
    return folder / f"{spec.file_stem}.pt", folder / f"{spec.file_stem}.json"


def save_checkpoint(
    folder: Path,
    spec: RunSpec,
    stateful: Mapping[str, Any],
    step: int,
    steps: int,
    history: list,
    elapsed: float,
) -> None:
    """Everything a resumed run needs to take step `step` (0-based: the steps before it are done) exactly
    as an uninterrupted run would, then its sidecar for the status view."""
    weights, sidecar = checkpoint_paths(folder, spec)
    state = dict(
        run=spec.key,
        step=step,
        history=history,
        elapsed_seconds=elapsed,
        objects={name: _state_of(value) for name, value in stateful.items()},
        torch_rng=torch.get_rng_state(),
        python_rng=random.getstate(),
        numpy_rng=numpy.random.get_state(),
    )
    weights.parent.mkdir(parents=True, exist_ok=True)
    with staged(weights, _temporary(weights), durable=True) as temporary:
        torch.save(state, temporary)
    atomic_write_json(sidecar, dict(run=spec.key, step=step, steps=steps, elapsed_seconds=elapsed,
                                    saved_at=time.time()))  # fmt: skip


def load_checkpoint(folder: Path, spec: RunSpec, stateful: Mapping[str, Any]) -> dict | None:
    """Restore `stateful` and the global RNGs from the run's checkpoint; its step, history and elapsed
    time, or None when the run has none."""
    weights, _ = checkpoint_paths(folder, spec)
    if not weights.exists():
        return None
    # A file this sweep wrote itself: it holds Python and numpy RNG states, which weights_only refuses.
    state = torch.load(weights, map_location="cpu", weights_only=False)
    if state["run"] != spec.key or set(state["objects"]) != set(stateful):
        raise SweepError(f"{weights}: a checkpoint of {state['run']} with {sorted(state['objects'])}, "
                         f"not of {spec.key} with {sorted(stateful)}")  # fmt: skip
    for name, value in stateful.items():
        _restore(value, state["objects"][name])
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    numpy.random.set_state(state["numpy_rng"])
    return state


def remove_checkpoint(folder: Path, spec: RunSpec) -> None:
    for path in checkpoint_paths(folder, spec):
        path.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------- the loop


def run_resumable(
    spec: RunSpec,
    folder: Path,
    stateful: Mapping[str, Any],
    train_step_fn: Callable[[int], dict],
    steps: int,
    finish_fn: Callable[[list[dict]], dict],
    checkpoint_minutes: float = 5.0,
) -> dict:
    """Run `spec` to its end in sweep `folder`, from its checkpoint if it has one; returns its result.

    `train_step_fn(i)` performs step i (drawing its batch from a generator in `stateful`) and returns
    its record; `finish_fn(history)` gives the run's figures (evaluation). The objects of `stateful`
    (model, optimizer, scheduler, batch generator) must be built as for a fresh run before the call: a
    checkpoint then overwrites their state. A run already in `results.jsonl` is returned as recorded,
    not run again. The result holds `train_seconds` (training over every resume) and `wall_seconds`
    (with `finish_fn`). A checkpoint is written every `checkpoint_minutes` (0: after every step) and after
    the last step; the result line is appended, then the checkpoint removed."""
    folder = Path(folder)
    done = read_results(folder).get(spec.key)
    if done is not None:
        return done
    state = load_checkpoint(folder, spec, stateful)
    first, history, elapsed = (0, [], 0.0) if state is None else (
        state["step"], state["history"], state["elapsed_seconds"]
    )  # fmt: skip
    started = last_saved = time.monotonic()
    for step in range(first, steps):
        history.append(train_step_fn(step))
        now = time.monotonic()
        if now - last_saved >= 60 * checkpoint_minutes or step + 1 == steps:
            save_checkpoint(folder, spec, stateful, step + 1, steps, history, elapsed + now - started)
            last_saved = now
    trained = elapsed + time.monotonic() - started
    figures = finish_fn(history)
    # The training time over every process that took part; finish_fn's own clock saw only the last.
    figures = dict(figures, train_seconds=trained)
    record = finish_run(folder, spec, figures, elapsed + time.monotonic() - started)
    remove_checkpoint(folder, spec)
    return record


def run_or_resume(
    folder: Path | None,
    spec: RunSpec,
    build: Callable[[], tuple[Mapping[str, Any], Callable[[int], dict], Callable[[list[dict]], dict]]],
    steps: int,
    checkpoint_minutes: float = 5.0,
) -> dict:
    """`build()`'s run (its stateful objects, step and finish functions, as `run_resumable` takes them):
    without a sweep `folder`, its `steps` steps and finish in one go; in a sweep, resumed from its
    checkpoint, or its recorded result without building anything when it is done."""
    if folder is not None:
        done = read_results(folder).get(spec.key)
        if done is not None:
            return done
    stateful, step, finish = build()
    if folder is None:
        return finish([step(index) for index in range(steps)])
    return run_resumable(spec, folder, stateful, step, steps, finish, checkpoint_minutes)


def finish_run(folder: Path, spec: RunSpec, figures: dict, wall_seconds: float) -> dict:
    """Append the result of `spec` (its `figures`, its key, family, arm, seed and wall time) to the
    sweep's results; returns the record. For a run that is not step-checkpointed, this alone makes it
    skipped on the next start."""
    record = dict(figures, run=spec.key, family=spec.family, arm=spec.arm, seed=spec.seed)
    record["wall_seconds"] = wall_seconds
    append_result(folder, record)
    return record


# ---------------------------------------------------------------------------------------------- status


@dataclass(frozen=True)
class RunStatus:
    run: str
    arm: str
    state: str  # "done", "running" (a checkpoint, no result) or "left"
    seconds: float | None  # done: its wall time; running: the time spent so far
    step: int | None = None
    steps: int | None = None
    estimate: float | None = None  # seconds still to go (running, left), None without a done run
    gap: float | None = None  # done: the record's held-out − training loss, where it has one


def _gap_of(record: Mapping[str, Any]) -> float | None:
    """A done run's held-out − training gap (`gap`, or `pretrain_gap` for a pretraining), if numeric."""
    value = record.get("gap", record.get("pretrain_gap"))
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def sweep_status(
    manifest: dict, results: Mapping[str, dict], progress: Mapping[str, dict]
) -> list[RunStatus]:
    """Each run of `manifest` as done / running / left (a pure function of the three records). The
    estimate of a run still to go is the mean wall time of the done runs of its arm, else of all done
    runs, less the time a running run has spent (or, where longer, a running run's steps left at its own
    pace so far)."""
    walls = [record["wall_seconds"] for record in results.values()]
    by_arm: dict[str, list[float]] = {}
    for record in results.values():
        by_arm.setdefault(record["arm"], []).append(record["wall_seconds"])
    statuses = []
    for run in manifest["runs"]:
        key, arm = run["run"], run["arm"]
        if key in results:
            record = results[key]
            statuses.append(RunStatus(key, arm, "done", record["wall_seconds"], gap=_gap_of(record)))
            continue
        typical = by_arm.get(arm) or walls
        expected = statistics.fmean(typical) if typical else None
        spent = progress.get(key, {}).get("elapsed_seconds")
        if key in progress:
            left = None if expected is None else max(0.0, expected - spent)
            step, steps = progress[key]["step"], progress[key]["steps"]
            if step > 0:
                # Its own pace, where its arm's mean says less (a longer run than the done ones).
                left = max(left or 0.0, spent / step * (steps - step))
            statuses.append(
                RunStatus(key, arm, "running", spent, progress[key]["step"], progress[key]["steps"], left)
            )
        else:
            statuses.append(RunStatus(key, arm, "left", None, estimate=expected))
    return statuses


def format_status(statuses: list[RunStatus]) -> str:
    """The status table: one line per run, then the counts and the estimate for the rest."""
    lines = []
    for status in statuses:
        if status.state == "done":
            detail = f"{status.seconds:.1f} s" + ("" if status.gap is None else f", gap {status.gap:+.4f}")
        elif status.state == "running":
            spent = f"step {status.step}/{status.steps}, {status.seconds:.1f} s so far"
            detail = f"{spent}, ~{_eta(status.estimate)} left"
        else:
            detail = f"~{_eta(status.estimate)}"
        lines.append(f"{status.state:<8} {status.run:<40} {detail}")
    counts = {state: sum(s.state == state for s in statuses) for state in ("done", "running", "left")}
    pending = [s.estimate for s in statuses if s.state != "done"]
    rest = "unknown (no run done yet)" if any(e is None for e in pending) else f"{sum(pending) / 60:.1f} min"
    lines.append(
        f"{counts['done']} done, {counts['running']} running, {counts['left']} left; "
        f"estimate for the rest: {rest} of run time (mean of done runs of the same arm, else of all; "
        "a running run at least its own pace)"
    )
    return "\n".join(lines)


def _eta(seconds: float | None) -> str:
    return "? s" if seconds is None else f"{seconds:.1f} s"


def read_status(folder: Path) -> list[RunStatus]:
    """`sweep_status` of the sweep in `folder`, from its manifest, results and checkpoint sidecars."""
    folder = Path(folder)
    check_sweep_folder(folder)
    path = folder / MANIFEST
    if not path.exists():
        raise SweepError(f"--sweep-dir {folder}: no {MANIFEST} (not a sweep folder, or not started yet)")
    manifest = json.loads(path.read_text(encoding="utf-8"))
    progress = {}
    for sidecar in sorted((folder / CHECKPOINTS).glob("*.json")):
        record = json.loads(sidecar.read_text(encoding="utf-8"))
        progress[record["run"]] = record
    return sweep_status(manifest, read_results(folder), progress)


def add_sweep_flags(parser: argparse.ArgumentParser) -> None:
    """`--sweep-dir`, `--checkpoint-minutes` and `--status`, for a reproduction script."""
    parser.add_argument("--sweep-dir", default=None, help="run as a resumable sweep in this folder")
    parser.add_argument(
        "--checkpoint-minutes",
        type=float,
        default=5.0,
        help="minutes between checkpoints of a run (0: every step)",
    )
    parser.add_argument("--status", action="store_true", help="print the sweep's status (needs --sweep-dir)")


def check_sweep_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.status and not args.sweep_dir:
        parser.error("--status needs --sweep-dir DIR")
    if args.checkpoint_minutes < 0:
        parser.error(f"--checkpoint-minutes={args.checkpoint_minutes} must be >= 0")


def open_sweep_or_exit(args: argparse.Namespace, runs: Callable[[], list[RunSpec]]) -> bool:
    """A reproduction script's `--sweep-dir` step: print the status (`--status`; True: nothing more to do)
    or open the sweep of `runs()`; a folder of another sweep, or no sweep for `--status`, exits 2 with its
    one-line reason."""
    try:
        if args.status:
            print(format_status(read_status(Path(args.sweep_dir))))
            return True
        open_sweep(Path(args.sweep_dir), runs())
    except SweepError as error:
        print(error, file=sys.stderr)
        raise SystemExit(2) from None
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Status of a sweep folder: each run done / running / left.")
    parser.add_argument("sweep_dir", help="the folder given as --sweep-dir")
    args = parser.parse_args(argv)
    try:
        print(format_status(read_status(Path(args.sweep_dir))))
    except SweepError as error:
        print(error, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
