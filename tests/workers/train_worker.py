"""TrainerCallback for the multi-process `hf-concept train` test (tests/test_train_command.py).

The test runs the real command under torchrun (gloo, CPU) with
`--callback tests.workers.train_worker:RecordRanks`; every rank then writes `rank{r}.pt` into the folder
named by $HF_CONCEPT_RANK_RECORD_DIR with:
- "steps": per optimizer step, the global-ratio statistics the rank's model used — the
  `RatioAccumulator`'s final counts (boundaries, sum of p, real tokens) of the step, summed over ranks and
  micro-batches — and how many micro-batches it saw;
- "micro_batches": per training forward, the local token count and the model's own metric fields;
- "logs": every `logs` dict `on_log` received (what reporting integrations get);
- "parameters": the final parameters.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers import TrainerCallback

RECORD_DIR_ENV = "HF_CONCEPT_RANK_RECORD_DIR"
METRICS = ("lm_loss", "aux_loss", "compression_ratio", "boundary_prob_mean")


class RecordRanks(TrainerCallback):
    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.micro_batches: list[dict[str, float]] = []
        self.logs: list[dict[str, float]] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        model.register_forward_hook(self._record_forward, with_kwargs=True)

    def _record_forward(self, module, args, kwargs, output) -> None:
        if not module.training:
            return
        record = {"tokens": int(kwargs["input_ids"].numel())}
        record.update({name: float(output[name]) for name in METRICS if output.get(name) is not None})
        self.micro_batches.append(record)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        accumulator = model.ratio_accumulator
        if accumulator is None:
            # Scopes other than "global" keep no step statistics.
            return
        planned = accumulator.planned_counts
        self.steps.append(
            {
                "counts": accumulator.running_counts.clone(),
                "planned": None if planned is None else planned.clone(),
                "micro_batches": accumulator.micro_batches_seen,
            }
        )

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))

    def on_train_end(self, args, state, control, model=None, **kwargs):
        record = {
            "steps": self.steps,
            "micro_batches": self.micro_batches,
            "logs": self.logs,
            "parameters": {name: value.detach().clone() for name, value in model.named_parameters()},
            "world_size": args.world_size,
        }
        torch.save(record, Path(os.environ[RECORD_DIR_ENV]) / f"rank{os.environ.get('RANK', '0')}.pt")


class RecordRun(TrainerCallback):
    """Single-process runs: keeps what a reporting integration sees (`on_log`), the optimizer's groups,
    the parameters after every optimizer step and the trained model, in `RecordRun.runs` (one dict per
    run, newest last)."""

    runs: ClassVar[list[dict[str, Any]]] = []

    def __init__(self) -> None:
        self.run: dict[str, Any] = {"logs": [], "snapshots": [], "groups": [], "model": None}
        RecordRun.runs.append(self.run)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.run["start"] = _parameters(model)
        self.run["groups"] = [
            {key: value for key, value in group.items() if key != "params"} | {"size": len(group["params"])}
            for group in optimizer.param_groups
        ]

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.run["snapshots"].append(_parameters(model))

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.run["logs"].append(dict(logs))

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.run["model"] = model


def _parameters(model) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.named_parameters() if value.requires_grad}
