"""A `Trainer` that logs the models' own metrics (lm_loss, aux_loss, realised compression, ...).

Models return these as detached fields of their `ModelOutput`. A callback cannot add them to the logs
(`Trainer.log` appends to `log_history` before callbacks run, HF_NOTES §4), so this subclass averages
them over the optimizer steps since the last log and merges them into `logs` before `Trainer.log`,
which makes them reach `state.log_history` and every reporting integration.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import Trainer

# Output fields averaged into the training logs when a model returns them.
METRIC_FIELDS = ("lm_loss", "aux_loss", "kl_loss", "compression_ratio", "boundary_prob_mean", "boundary_rate")


class ConceptTrainer(Trainer):
    """`Trainer` that also logs the metric fields (`METRIC_FIELDS`) a model puts in its outputs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._metric_sums: dict[str, float] = {}
        self._metric_counts: dict[str, int] = {}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(
            model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch
        )
        if model.training:
            self._accumulate(outputs)
        return (loss, outputs) if return_outputs else loss

    def _accumulate(self, outputs: Any) -> None:
        for name in METRIC_FIELDS:
            value = outputs.get(name) if hasattr(outputs, "get") else None
            if value is None:
                continue
            value = value.detach().float().mean() if isinstance(value, torch.Tensor) else float(value)
            self._metric_sums[name] = self._metric_sums.get(name, 0.0) + float(value)
            self._metric_counts[name] = self._metric_counts.get(name, 0) + 1

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # Only training logs (they carry "loss") get the running averages; eval logs pass through.
        if "loss" in logs and self._metric_counts:
            for name, total in self._metric_sums.items():
                logs[name] = round(total / self._metric_counts[name], 6)
            self._metric_sums.clear()
            self._metric_counts.clear()
        super().log(logs, start_time)
