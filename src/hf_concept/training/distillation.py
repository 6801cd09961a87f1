"""Distillation from a source model: the source (the teacher) teaches the model converted from it.

A converted checkpoint that compresses (ConceptMoE at R > 1, Hidden Decoding in a lossy layout) starts
away from its source; the LM loss gives one label per position to bring it back, the source's full
next-token distribution gives a whole distribution. `DistillationTrainer` adds to the student's own loss
(its LM loss and its family's terms, e.g. the ratio loss):

- `distillation_kl`: T² · KL(teacher ‖ student) of the temperature-T distributions at every label
  position, summed and divided by the step's label count (a share, as the LM loss is);
- `hidden_alignment` (weight `align_hidden`, off by default): 1 − cosine similarity of the student's and
  the teacher's token states where the conversion's layer map pairs them (`alignment_pairs`: in a
  ConceptMoE conversion each decoder layer's output, which reads the dechunked concepts, and the source
  layer it was copied from; elsewhere the last states), at the same positions and with the same
  normalisation, averaged over the pairs.

The teacher runs in eval mode without gradients, on the student's device; it is never saved.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_concept.training.errors import TrainSetupError
from hf_concept.training.recipe_trainer import RecipeTrainer

IGNORE_INDEX = -100


def _at_least_float32(tensor: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 values in float32 (softmax and cosine over a vocabulary need it); float64 stays."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def label_positions(labels: torch.Tensor) -> torch.Tensor:
    """(B, L) labels aligned with the inputs -> (B, L) bool: the positions whose logits predict a label
    (position t predicts labels[t + 1]; the last position predicts nothing)."""
    following = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    return following != IGNORE_INDEX


def distillation_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    positions: torch.Tensor,
    temperature: float = 1.0,
    normalizer: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """T² · Σ_positions KL(softmax(teacher / T) ‖ softmax(student / T)) / normalizer.

    Forward value: with p = softmax(teacher / T) and q = softmax(student / T) over the vocabulary, the sum
    over the `positions` (B, L) bool of Σ_v p_v (log p_v − log q_v), times T², divided by `normalizer`
    (default: the number of positions; under gradient accumulation the step's label count, so that the
    micro-batches' values add up to the step's mean). Backward rule: the exact gradient with respect to
    the student's logits, T · (q − p) / normalizer at each position (the T² keeps its scale independent
    of T); the teacher's logits are detached and receive none. Computed in float32 at least.
    """
    student = _at_least_float32(student_logits[positions]) / temperature  # (N, V)
    teacher = _at_least_float32(teacher_logits[positions].detach()) / temperature
    log_q, log_p = F.log_softmax(student, dim=-1), F.log_softmax(teacher, dim=-1)
    total = (log_p.exp() * (log_p - log_q)).sum() * temperature**2
    count = positions.sum().clamp(min=1) if normalizer is None else normalizer
    return total / count


def hidden_alignment(
    student_states: torch.Tensor,
    teacher_states: torch.Tensor,
    positions: torch.Tensor,
    normalizer: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Σ_positions (1 − cos(student_t, teacher_t)) / normalizer over (B, L, D) token states.

    Forward value: one minus the cosine similarity of the two states at each of the `positions`, summed
    and divided by `normalizer` (default: the number of positions). Scale-free, so that a source whose
    last states have large norms does not outweigh the KL term. Backward rule: the exact gradient with
    respect to the student's states; the teacher's are detached and receive none.
    """
    student = _at_least_float32(student_states[positions])
    teacher = _at_least_float32(teacher_states[positions].detach())
    total = (1.0 - F.cosine_similarity(student, teacher, dim=-1)).sum()
    count = positions.sum().clamp(min=1) if normalizer is None else normalizer
    return total / count


def alignment_pairs(student_config: Any, teacher_layers: int) -> list[tuple[int, int]]:
    """(student, teacher) indices into the two models' `hidden_states` whose token states the conversion
    makes equal at step 0: for a ConceptMoE converted from a `teacher_layers`-layer source, decoder layer k
    (a copy of source layer teacher_layers − decoder_layers + k) after the encoder's and the concept
    passes' entries; the concept passes hold concepts, not token states, and the encoder is the source's
    own first layers, so neither is paired. Other students: the last states only (the last layer maps onto
    the last layer in every conversion)."""
    if getattr(student_config, "model_type", None) != "conceptmoe":
        return [(-1, -1)]
    decoder = student_config.decoder_layers
    first_decoder = 1 + student_config.encoder_layers + len(student_config.concept_layer_schedule())
    return [(first_decoder + k, teacher_layers - decoder + k + 1) for k in range(decoder)]


def mapped_alignment(
    student_config: Any,
    student_states: tuple[torch.Tensor, ...],
    teacher_states: tuple[torch.Tensor, ...],
    positions: torch.Tensor,
    normalizer: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """`hidden_alignment` averaged over the `alignment_pairs` of the two models' `hidden_states` tuples."""
    pairs = alignment_pairs(student_config, len(teacher_states) - 1)
    terms = [
        hidden_alignment(student_states[ours], teacher_states[theirs], positions, normalizer)
        for ours, theirs in pairs
    ]
    return sum(terms) / len(terms)


def check_distillation_options(source: Any, temperature: float, align_hidden: float) -> None:
    """Refuse a temperature or weight that cannot work, and the distillation options without a source."""
    if source is None and (temperature != 1.0 or align_hidden != 0.0):
        raise TrainSetupError("--distill-temperature and --align-hidden go with --distill-from SOURCE")
    # `not >` also refuses NaN; an infinite temperature would multiply a zero KL by an infinite T².
    if not (temperature > 0 and math.isfinite(temperature)):
        raise TrainSetupError(f"--distill-temperature {temperature} must be a positive finite number")
    if not (align_hidden >= 0 and math.isfinite(align_hidden)):
        raise TrainSetupError(f"--align-hidden {align_hidden} must be 0 (off) or a positive weight")


def _vocabulary(tokenizer: Any) -> dict[str, int] | None:
    return tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else None


def load_teacher(source: str | Path, student: torch.nn.Module, tokenizer: Any) -> torch.nn.Module:
    """The source model at `source`, in the student's dtype, for `DistillationTrainer`; refused in one line
    when it cannot be read or when its vocabulary or tokenizer differs from the student's (the KL term
    compares distributions over the same token ids)."""
    try:
        teacher = AutoModelForCausalLM.from_pretrained(source, dtype=student.dtype)
    except (OSError, ValueError) as error:
        raise TrainSetupError(
            f"--distill-from {source}: not a model folder transformers can load ({error})"
        ) from None
    sizes = (teacher.get_output_embeddings().weight.shape[0], student.get_output_embeddings().weight.shape[0])
    if sizes[0] != sizes[1]:
        raise TrainSetupError(
            f"--distill-from {source}: its vocabulary has {sizes[0]} ids and the model's {sizes[1]}: distill "
            "from the source the model was converted from"
        )
    try:
        theirs = _vocabulary(AutoTokenizer.from_pretrained(source))
    except (OSError, ValueError):
        theirs = None  # a source folder without tokenizer files: the sizes above are all there is to compare
    ours = _vocabulary(tokenizer)
    if theirs is not None and ours is not None and theirs != ours:
        differing = sorted(set(theirs.items()) ^ set(ours.items()), key=lambda item: item[1])[:3]
        raise TrainSetupError(
            f"--distill-from {source}: its tokenizer differs from the model's (e.g. {differing}): distill "
            "from the source the model was converted from, with the same tokenizer"
        )
    return teacher


class DistillationTrainer(RecipeTrainer):
    """`RecipeTrainer` whose loss adds the teacher's terms (module docstring) to the student's own, each
    logged on its own (`distill_loss`, `align_loss`; `eval_`-prefixed in evaluation)."""

    def __init__(
        self,
        *args: Any,
        teacher_model: torch.nn.Module,
        distill_temperature: float = 1.0,
        align_hidden: float = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.teacher_model = teacher_model.eval().requires_grad_(False)
        self.teacher_model.to(self.args.device)
        self.distill_temperature = distill_temperature
        self.align_hidden = align_hidden

    def model_loss(self, model, inputs, num_items_in_batch=None) -> tuple[torch.Tensor, Any]:
        aligning = self.align_hidden > 0
        student_inputs = {**inputs, "output_hidden_states": True} if aligning else inputs
        loss, outputs = super().model_loss(model, student_inputs, num_items_in_batch)
        teacher = self.teacher_outputs(inputs, aligning)
        positions = label_positions(inputs["labels"])
        normalizer = None
        if num_items_in_batch is not None and self.model_accepts_loss_kwargs:
            normalizer = num_items_in_batch
        kl = distillation_kl(outputs.logits, teacher.logits, positions, self.distill_temperature, normalizer)
        scale = self.loss_scale(num_items_in_batch)
        loss = loss + scale * kl
        outputs["distill_loss"] = kl.detach()
        if aligning:
            aligned = mapped_alignment(
                self.model.config, outputs.hidden_states, teacher.hidden_states, positions, normalizer
            )
            loss = loss + scale * self.align_hidden * aligned
            outputs["align_loss"] = aligned.detach()
        return loss, outputs

    def loss_scale(self, num_items_in_batch: Any) -> int:
        """The factor `Trainer.compute_loss` multiplies the model's loss by (in place, so it cannot be read
        back): with tokens averaged across processes each process's share of the step is scaled by their
        number (DDP then averages the gradients); the added terms, shares of the same count, must be too.
        Tensor parallelism, which would divide it, is not used by these recipes."""
        args = self.args
        averaged = getattr(args, "average_tokens_across_devices", False) and self.model_accepts_loss_kwargs
        if not averaged or num_items_in_batch is None:
            return 1
        return args.n_gpu if args.n_gpu > 1 else self.accelerator.num_processes

    @torch.no_grad()
    def teacher_outputs(self, inputs: dict[str, Any], hidden_states: bool) -> Any:
        """The teacher's outputs on the student's batch (no labels: its own loss is not needed)."""
        names = ("input_ids", "attention_mask", "position_ids")
        batch = {name: inputs[name] for name in names if inputs.get(name) is not None}
        return self.teacher_model(**batch, output_hidden_states=hidden_states, use_cache=False)
