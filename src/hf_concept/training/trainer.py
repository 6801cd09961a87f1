"""A `Trainer` that logs the models' own metrics (lm_loss, aux_loss, realised compression, ...) and
gives models with a global ratio loss the statistics of the whole optimizer step.

Models return these as detached fields of their `ModelOutput`. A callback cannot add them to the logs
(`Trainer.log` appends to `log_history` before callbacks run, HF_NOTES §4), so this subclass averages
them over the optimizer steps since the last log and merges them into `logs` before `Trainer.log`,
which makes them reach `state.log_history` and every reporting integration.

Global ratio loss under gradient accumulation: a model with a `ratio_accumulator` attribute and
`config.ratio_scope == "global"` gets a `RatioAccumulator` reset at the start of every optimizer step,
with the step's real-token count summed over all processes (Trainer fetches a step's micro-batches up
front, so the count is known before the first forward). Without it every micro-batch would add a full
share of its own loss, counting the aux term once per accumulation step.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import Trainer

from hf_concept.modeling.routing import RatioAccumulator

# Output fields averaged into the training logs when a model returns them.
METRIC_FIELDS = ("lm_loss", "aux_loss", "kl_loss", "compression_ratio", "boundary_prob_mean", "boundary_rate")


class ConceptTrainer(Trainer):
    """`Trainer` that also logs the metric fields (`METRIC_FIELDS`) a model puts in its outputs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The running statistics of the current optimizer step (global ratio loss), if the model has one.
        self.ratio_accumulator: RatioAccumulator | None = None
        self._metric_sums: dict[str, float] = {}
        self._metric_counts: dict[str, int] = {}

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if batch_samples:
            self._start_ratio_step(batch_samples, device)
        return batch_samples, num_items_in_batch

    def _ratio_model(self) -> torch.nn.Module | None:
        """The model that owns a global ratio loss, under any DDP/PEFT wrapping; None if there is none."""
        model = self.accelerator.unwrap_model(self.model)
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        if not hasattr(model, "ratio_accumulator"):
            return None
        return model if getattr(model.config, "ratio_scope", None) == "global" else None

    def _start_ratio_step(self, batch_samples: list, device: torch.device) -> None:
        model = self._ratio_model()
        if model is None:
            return
        tokens = 0
        for batch in batch_samples:
            mask = batch.get("attention_mask")
            tokens += int(mask.sum()) if mask is not None else batch["input_ids"].numel()
        step_tokens = self.accelerator.reduce(torch.tensor(tokens, device=device), reduction="sum")
        accumulator = self.ratio_accumulator
        if accumulator is None or accumulator.num_micro_batches != len(batch_samples):
            accumulator = self.ratio_accumulator = RatioAccumulator(len(batch_samples))
        accumulator.reset(step_token_count=int(step_tokens))
        model.ratio_accumulator = accumulator

    def train(self, *args: Any, **kwargs: Any):
        try:
            return super().train(*args, **kwargs)
        finally:
            # Outside training steps the model must not count micro-batches of a step that is over.
            model = self._ratio_model()
            if model is not None:
                model.ratio_accumulator = None

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
