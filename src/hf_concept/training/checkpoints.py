"""Trainer checkpoints that survive a kill, runs that stop when they diverge, and resuming.

- A checkpoint is *complete* when it holds weights (full or a LoRA adapter; every shard an index names,
  each safetensors file as long as its header says), `optimizer.pt`, `scheduler.pt` and a
  `trainer_state.json` that parses. `checkpoint_problems` says what is missing; `latest_checkpoint` picks
  the newest complete one and warns about each incomplete one it skips.
- `SafeCheckpointsMixin` writes each checkpoint under a hidden staging folder and renames it into place
  once every file is written, so a kill never leaves a `checkpoint-N` that looks complete and is not. Each
  one records the run's settings (`run_settings.json`, `hf_concept.training.run_settings`). It
  refuses to save non-finite weights, and stops training at the first non-finite loss or gradient norm
  with `TrainingDivergedError` naming the step.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any

import torch

from hf_concept.safetensors_check import safetensors_defect
from hf_concept.training.errors import (
    OutputWriteError,
    TrainingDivergedError,
    TrainSetupError,
    is_write_failure,
    write_failure_cause,
    write_failure_hint,
)
from hf_concept.training.run_settings import write_run_settings

logger = logging.getLogger("hf_concept.train")

CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
STAGING_PREFIX = ".staging-"
TRAINING_STATE_FILES = ("optimizer.pt", "scheduler.pt", "trainer_state.json")
WEIGHT_FILES = ("model.safetensors", "adapter_model.safetensors")
WEIGHT_INDEX = "model.safetensors.index.json"


def safetensors_problem(path: Path) -> str | None:
    """Why `path` is not a whole safetensors file (None when it is; `hf_concept.safetensors_check` decides):
    a file cut short by a kill fails this, and so does one that is not safetensors at all (only the header
    is read, however large it claims to be)."""
    try:
        defect = safetensors_defect(path)
    except OSError as error:
        return f"{path.name} is unreadable ({error.strerror or type(error).__name__})"
    if defect is None:
        return None
    if defect.kind == "size":
        return f"{path.name} has {defect.size} bytes, its header needs {defect.expected}"
    return f"{path.name} is not a valid safetensors file ({defect.detail})"


def weight_files(folder: Path) -> list[Path]:
    """The safetensors weight files of a checkpoint: the shards its index names, else the full or
    adapter weights present (check completeness with `checkpoint_problems` first)."""
    index = folder / WEIGHT_INDEX
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / name for name in shards]
    return [folder / name for name in WEIGHT_FILES if (folder / name).is_file()]


def _weight_problems(folder: Path) -> list[str]:
    index = folder / WEIGHT_INDEX
    try:
        files = weight_files(folder)
    except (ValueError, KeyError, TypeError, AttributeError):
        return [f"{WEIGHT_INDEX} is not a valid index"]
    if index.is_file():
        missing = [path.name for path in files if not path.is_file()]
        if missing:
            return [f"shards {missing} named by {WEIGHT_INDEX} are missing"]
    elif not files:
        return [f"no weights ({' or '.join(WEIGHT_FILES)} or {WEIGHT_INDEX})"]
    return [problem for problem in map(safetensors_problem, files) if problem]


def _archive_problem(path: Path) -> str | None:
    """`torch.save` writes a zip archive whose directory is at the end: a file cut short has none."""
    if not zipfile.is_zipfile(path):
        return f"{path.name} is cut short or not a torch.save file (no zip central directory)"
    return None


def checkpoint_problems(folder: str | Path) -> list[str]:
    """What keeps `folder` from being a complete Trainer checkpoint; empty when it is one."""
    folder = Path(folder)
    if not folder.is_dir():
        return [f"{folder} is not a folder"]
    problems = _weight_problems(folder)
    for name in TRAINING_STATE_FILES:
        path = folder / name
        if not path.is_file() or path.stat().st_size == 0:
            problems.append(f"{name} is missing")
        elif path.suffix == ".pt" and (problem := _archive_problem(path)):
            problems.append(problem)
    state = folder / "trainer_state.json"
    if state.is_file() and state.stat().st_size:
        try:
            json.loads(state.read_text())["global_step"]
        except (ValueError, KeyError, TypeError):
            problems.append("trainer_state.json is not a valid trainer state")
    return problems


def latest_checkpoint(folder: str | Path) -> Path | None:
    """The complete `checkpoint-N` with the highest N in `folder` (None if there is none); every
    incomplete one that is newer is skipped with a warning naming what it lacks.

    Not transformers' `get_last_checkpoint`: that returns the highest-numbered `checkpoint-N` folder
    whatever it holds, so a checkpoint cut short by a kill or a full disk would be resumed from."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    found = [(int(match[1]), path) for path in folder.iterdir() if (match := CHECKPOINT.match(path.name))]
    for _, path in sorted(found, reverse=True):
        problems = checkpoint_problems(path)
        if not problems:
            return path
        logger.warning(f"skipping incomplete checkpoint {path}: {'; '.join(problems)}")
    return None


def remove_stale_staging(folder: str | Path) -> None:
    """Remove the staging folders a killed run left in its checkpoint folder (only this run writes there)."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for path in folder.iterdir():
        if path.name.startswith(STAGING_PREFIX) and path.is_dir():
            logger.warning(f"removing {path}, a checkpoint that an interrupted run did not finish writing")
            shutil.rmtree(path)


def non_finite_parameters(model: torch.nn.Module, limit: int = 3) -> list[str]:
    """Names of (at most `limit`) parameters holding NaN or inf."""
    names = []
    for name, parameter in model.named_parameters():
        if not bool(torch.isfinite(parameter.detach()).all()):
            names.append(name)
            if len(names) == limit:
                break
    return names


# The private `Trainer` methods the mixin overrides, with the parameters it passes on; a test checks them
# against the installed transformers (unchanged from 5.15 to 5.24). Why no public hook serves instead:
# - `_get_grad_norm`: the norm Trainer computed for clipping and logging, before the optimizer step; the
#   callbacks' `on_pre_optimizer_step` gets no norm (a callback would pass over every gradient again).
# - `_get_output_dir`, `_save_checkpoint`: the checkpoint is written into a staging folder and renamed
#   into place; `on_save` runs after the folder is written under its final name.
# - `_load_from_checkpoint`, `_load_optimizer_and_scheduler`: a checkpoint that does not fit the run is
#   named as such; callbacks start after both loads, and wrapping the public `train()` would blame the
#   checkpoint for any other setup error.
PRIVATE_TRAINER_METHODS = {
    "_get_grad_norm": ("model", "grad_norm"),
    "_get_output_dir": ("trial",),
    "_save_checkpoint": ("model", "trial"),
    "_load_from_checkpoint": ("resume_from_checkpoint", "model"),
    "_load_optimizer_and_scheduler": ("checkpoint",),
}


class SafeCheckpointsMixin:
    """Trainer mixin: atomic checkpoints, and a stop at the first non-finite loss, gradient norm or weight.

    Overrides the public `training_step` (a micro-batch's loss) and the private methods of
    `PRIVATE_TRAINER_METHODS` (the reasons are there).
    """

    _checkpoint_staging: str | None = None
    # The run's settings (`run_settings.current_settings`), recorded in every checkpoint; None: not recorded.
    run_settings: dict[str, Any] | None = None

    def _diverged(self, what: str, after_step: bool = False) -> TrainingDivergedError:
        """The error for `what`, seen during the coming optimizer step or, `after_step`, after the last."""
        step = self.state.global_step + (0 if after_step else 1)
        rate = self.args.learning_rate
        return TrainingDivergedError(
            f"training diverged at optimizer step {step}: {what}. The likely cause is the learning rate "
            f"({rate:g}): lower --learning-rate (or add --warmup-steps). Nothing non-finite was saved."
        )

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        # With several processes a rank's own loss is not checked: ranks must stop at the same point, and
        # a non-finite loss on any rank makes the synchronised gradient norm non-finite on all of them.
        if self.accelerator.num_processes == 1:
            value = float(loss.detach())
            if not math.isfinite(value):
                raise self._diverged(f"the training loss is {value}")
        return loss

    def _get_grad_norm(self, model, grad_norm=None):
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        value = float(grad_norm) if grad_norm is not None else 0.0
        if not math.isfinite(value):
            raise self._diverged(f"the gradient norm is {value}")
        return grad_norm

    def check_finite_weights(self, model: torch.nn.Module) -> None:
        """Raise `TrainingDivergedError` when a parameter of `model` holds NaN or inf."""
        bad = non_finite_parameters(model)
        count = len(bad)
        if self.accelerator.num_processes > 1:
            # Sharded weights (FSDP) differ per rank: every rank must take the same decision.
            flag = torch.tensor(count, device=self.args.device)
            count = int(self.accelerator.reduce(flag, reduction="sum"))
        if count:
            named = bad or "on another process"
            raise self._diverged(f"parameters {named} hold NaN or inf", after_step=True)

    def _get_output_dir(self, trial: Any) -> str:
        if self._checkpoint_staging is not None:
            return self._checkpoint_staging
        return super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        self.check_finite_weights(model)
        run_dir = Path(super()._get_output_dir(trial))
        name = f"checkpoint-{self.state.global_step}"
        staging = run_dir / f"{STAGING_PREFIX}{name}"
        if self.is_world_process_zero():
            shutil.rmtree(staging, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        self._checkpoint_staging = str(staging)
        try:
            super()._save_checkpoint(model, trial)
            if self.run_settings is not None and self.is_world_process_zero():
                # Inside the staging folder: the settings appear with the checkpoint, in its rename.
                write_run_settings(staging / name, self.run_settings)
        except Exception as error:
            # A failed save (a full disk) leaves nothing half-written; a kill (not an Exception) leaves the
            # staging folder, which the next run removes.
            if self.is_world_process_zero():
                shutil.rmtree(staging, ignore_errors=True)
            if is_write_failure(error):
                raise self._write_failed(name, run_dir, error) from None
            raise
        finally:
            self._checkpoint_staging = None
        self.accelerator.wait_for_everyone()
        if self.is_world_process_zero():
            final = run_dir / name
            # A checkpoint of the same step can only be a leftover of an interrupted run: replace it.
            if final.exists():
                shutil.rmtree(final)
            os.replace(staging / name, final)
            staging.rmdir()
        self.accelerator.wait_for_everyone()

    def _write_failed(self, name: str, run_dir: Path, error: BaseException) -> OutputWriteError:
        newest = latest_checkpoint(run_dir)
        kept = f"the newest complete one is {newest.name}" if newest else "no complete one is there yet"
        return OutputWriteError(
            f"could not write {name} into {run_dir}: {write_failure_cause(error, run_dir)}; the partial "
            f"checkpoint was removed and {kept}: {write_failure_hint(error, '--output-dir')}, then run again "
            "with --resume"
        )

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        try:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        except (RuntimeError, ValueError, KeyError) as error:
            raise _resume_failed(resume_from_checkpoint, "its weights", error) from None

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        try:
            super()._load_optimizer_and_scheduler(checkpoint)
        except (RuntimeError, ValueError, KeyError, EOFError, pickle.UnpicklingError) as error:
            raise _resume_failed(checkpoint, "its optimizer or scheduler state", error) from None


def _resume_failed(checkpoint: str | None, what: str, error: BaseException) -> TrainSetupError:
    """The one line for a checkpoint Trainer could not load (the checks of `training.resume` catch the
    known cases first; this names the rest)."""
    text = str(error).strip()
    first = text.splitlines()[0][:200] if text else type(error).__name__
    return TrainSetupError(
        f"{checkpoint}: {what} do not fit this run ({first}): resume with the model and flags that wrote it "
        "(--lora, --mup), or start this run in another --output-dir"
    )
