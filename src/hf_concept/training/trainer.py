"""A `Trainer` that logs the models' own metrics (lm_loss, aux_loss, realised compression, ...) and
gives models with a global ratio loss the statistics of the whole optimizer step.

Models return these as detached fields of their `ModelOutput`. A callback cannot add them to the logs
(`Trainer.log` appends to `log_history` before callbacks run), so this subclass accumulates
them and merges them into `logs` before `Trainer.log`, which makes them reach `state.log_history` and every
reporting integration. Each logged value is the global figure of the optimizer steps since the last log:
- `SHARE_FIELDS` (lm_loss, aux_loss) are shares when Trainer passes `num_items_in_batch`: each
  micro-batch returns its part of the step's token-weighted value (LM loss summed over its label tokens
  and divided by the step's count over all micro-batches and ranks; the ratio loss likewise). They are
  summed over the step's micro-batches and ranks, then averaged over steps, so `lm_loss` matches `loss`
  whatever the accumulation steps and the number of processes.
- the compression ratios (`RATIO_FIELDS`, tokens per concept) are all the span's real tokens over all
  its concepts, on every rank;
- every other field (mean boundary probability, ...), and a share field of a model that does not take
  `num_items_in_batch` (LSLM's per-batch means), is averaged over the micro-batches of every rank.
With several processes one all-reduce of a fixed-size table runs at each log, on every rank, so every
rank logs the same values. Evaluation gets the per-batch fields with the evaluation prefix
(`eval_compression_ratio`, `eval_lm_loss`, ...), over the evaluation batches of all ranks (ratios as
above); the ratio loss is left out there, since a global-scope aux value is a share of the ranks' joint
batch.

Global ratio loss under gradient accumulation: a model with a `ratio_accumulator` attribute and
`config.ratio_scope == "global"` gets a `RatioAccumulator` reset at the start of every optimizer step,
with the step's real-token count summed over all processes (Trainer fetches a step's micro-batches up
front, so the count is known before the first forward). Without it every micro-batch would add a full
share of its own loss, counting the aux term once per accumulation step (a plain `Trainer` therefore
gets the batch scope, with one warning when the step holds more than one micro-batch or process:
`ConceptCausalLMMixin.unplanned_global_scope`). The step is also planned
(`ratio_step.plan_ratio_step`): each micro-batch's boundary decisions are drawn before the step's first
forward and replayed by it, so every micro-batch uses the step's boundary fraction, and k accumulated
micro-batches give the loss and gradients of one batch k times as large.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import Trainer
from transformers.trainer_utils import EvalLoopOutput

from hf_concept.modeling.ratio_step import RatioAccumulator, plan_ratio_step

# Output fields merged into the training logs when a model returns them.
METRIC_FIELDS = (
    "lm_loss",
    "aux_loss",
    "kl_loss",
    "compression_ratio",
    # ConceptMoE/DLCM: the realised ratio with inference's (thresholded) boundaries on the same tokens,
    # and the one expected under training's sampler (what evaluation reports as the training rate).
    "inference_compression_ratio",
    "sampled_compression_ratio",
    "boundary_prob_mean",
    "boundary_rate",
    # LSLM: the rate training samples at (mean q) and the rate its inference rule gives on those bytes.
    "expected_boundary_rate",
    "inference_boundary_rate",
    # Distillation from the source (`training.distillation`): the KL term and the hidden alignment.
    "distill_loss",
    "align_loss",
)
# Fields that are micro-batch shares of the step's value when Trainer passes num_items_in_batch.
SHARE_FIELDS = ("lm_loss", "aux_loss", "distill_loss", "align_loss")
# Tokens per concept: over several micro-batches, all their tokens over all their concepts (a mean of the
# micro-batches' ratios would weigh a short micro-batch like a long one and lean towards the larger ratios).
RATIO_FIELDS = ("compression_ratio", "inference_compression_ratio", "sampled_compression_ratio")
EVAL_FIELDS = tuple(name for name in METRIC_FIELDS if name != "aux_loss")


class ConceptTrainer(Trainer):
    """`Trainer` that also logs the metric fields (`METRIC_FIELDS`) a model puts in its outputs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The running statistics of the current optimizer step (global ratio loss), if the model has one.
        self.ratio_accumulator: RatioAccumulator | None = None
        # The micro-batches of a step whose plan (ratio_step.plan_ratio_step) is still to be drawn.
        self._unplanned_step: list | None = None
        # Per field: the running sum, and its weight (micro-batches; optimizer steps for a summed share).
        self._metric_sums: dict[str, float] = {}
        self._metric_counts: dict[str, float] = {}
        self._share_fields: set[str] = set()
        self._eval_sums: dict[str, float] = {}
        self._eval_counts: dict[str, float] = {}

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
        # Fixed chunking has no ratio loss to plan. The plan draws the step's boundaries, so it runs at the
        # step's first forward (compute_loss), not here: on resume, Trainer restores the RNG state only
        # after fetching the step's batches, and a plan drawn before that would differ from the
        # uninterrupted run's.
        planned = getattr(model.config, "chunking", None) != "fixed"
        self._unplanned_step = batch_samples if planned else None

    def train(self, *args: Any, **kwargs: Any):
        try:
            return super().train(*args, **kwargs)
        finally:
            # Outside training steps the model must not count micro-batches of a step that is over.
            self._unplanned_step = None
            model = self._ratio_model()
            if model is not None:
                model.ratio_accumulator = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training and self._unplanned_step is not None:
            # The step's boundary counts before its first forward: every micro-batch then uses the step's
            # F, as one big batch would (ratio_step.py).
            batches, self._unplanned_step = self._unplanned_step, None
            plan_ratio_step(self._ratio_model(), [self._prepare_inputs(batch) for batch in batches])
        loss, outputs = self.model_loss(model, inputs, num_items_in_batch)
        if model.training:
            shares = num_items_in_batch is not None and self.model_accepts_loss_kwargs
            # A share counts as 1/k of a step, so that a step's k micro-batches add up to one step.
            share_weight = 1.0 / max(getattr(self, "current_gradient_accumulation_steps", 1), 1)
            # A model may say which of its fields are shares (LSLM: none; its lm_loss is a batch mean).
            share_fields = getattr(self.accelerator.unwrap_model(model), "metric_share_fields", SHARE_FIELDS)
            for name, value in self._metric_values(outputs, METRIC_FIELDS).items():
                weight = 1.0
                if shares and name in share_fields:
                    weight = share_weight
                    self._share_fields.add(name)
                self._add_metric(self._metric_sums, self._metric_counts, name, value, weight, inputs)
        else:
            for name, value in self._metric_values(outputs, EVAL_FIELDS).items():
                self._add_metric(self._eval_sums, self._eval_counts, name, value, 1.0, inputs)
        return (loss, outputs) if return_outputs else loss

    @staticmethod
    def _add_metric(sums: dict, counts: dict, name: str, value: float, weight: float, inputs: dict) -> None:
        """Add one micro-batch's `value`: weighted by `weight`, or for a ratio field (`RATIO_FIELDS`) as its
        tokens over its concepts, so that the logged figure is the span's tokens per concept."""
        mask, input_ids = inputs.get("attention_mask"), inputs.get("input_ids")
        if name in RATIO_FIELDS and value > 0 and (mask is not None or input_ids is not None):
            tokens = float(mask.sum()) if mask is not None else float(input_ids.numel())
            value, weight = tokens, tokens / value
        sums[name] = sums.get(name, 0.0) + value
        counts[name] = counts.get(name, 0.0) + weight

    def model_loss(self, model, inputs, num_items_in_batch=None) -> tuple[torch.Tensor, Any]:
        """(loss, outputs): the loss the model computes itself (LM loss plus its ratio or KL term), as
        `Trainer.compute_loss` takes it. Named here so that a subclass of another trainer (TRL's
        `SFTTrainer`, whose own `compute_loss` projects the LM head itself and drops those terms) keeps it."""
        return Trainer.compute_loss(
            self, model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch
        )

    @staticmethod
    def _metric_values(outputs: Any, names: tuple[str, ...]) -> dict[str, float]:
        values = {}
        for name in names:
            value = outputs.get(name) if hasattr(outputs, "get") else None
            if value is not None:
                values[name] = float(
                    value.detach().float().mean() if isinstance(value, torch.Tensor) else value
                )
        return values

    def _global_means(
        self, sums: dict[str, float], counts: dict[str, float], names: tuple[str, ...], shares: set[str]
    ) -> dict[str, float]:
        """Each field's total over every process divided by its total weight; the running sums are cleared.

        Every rank must call this at the same point: with several processes it is one all-reduce of a
        fixed-size table (every field of `names`, present or not), so ranks that saw different fields
        still take part in the same collective. A share's weight counts optimizer steps per rank, so its
        all-reduced weight is steps × processes while its sum already adds up the processes' parts: the
        number of processes is multiplied back in.
        """
        # MPS has no float64; elsewhere float64 keeps the sums exact enough for the 6 logged digits.
        dtype = torch.float32 if self.args.device.type == "mps" else torch.float64
        rows = [[sums.get(name, 0.0), counts.get(name, 0.0)] for name in names]
        table = torch.tensor(rows, dtype=dtype, device=self.args.device)
        processes = self.accelerator.num_processes
        if processes > 1:
            table = self.accelerator.reduce(table, reduction="sum")
        sums.clear()
        counts.clear()
        means = {}
        for name, (total, weight) in zip(names, table.tolist(), strict=True):
            if weight > 0:
                means[name] = round(total / weight * (processes if name in shares else 1), 6)
        return means

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # Only training logs (they carry "loss", on every rank at the same step) get the running means.
        if "loss" in logs:
            means = self._global_means(
                self._metric_sums, self._metric_counts, METRIC_FIELDS, self._share_fields
            )
            logs.update(means)
        super().log(logs, start_time)

    def evaluation_loop(
        self,
        dataloader,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> EvalLoopOutput:
        self._eval_sums.clear()
        self._eval_counts.clear()
        output = super().evaluation_loop(
            dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix
        )
        means = self._global_means(self._eval_sums, self._eval_counts, EVAL_FIELDS, set())
        output.metrics.update({f"{metric_key_prefix}_{name}": value for name, value in means.items()})
        return output
