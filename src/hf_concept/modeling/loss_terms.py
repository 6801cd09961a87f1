"""Warnings for training set-ups that silently change the loss a family optimises.

The concept families' training loss is more than the next-token cross-entropy: ConceptMoE and DLCM add
`aux_loss_weight` · ratio loss, LSLM adds `kl_weight` · KL (its negative ELBO). Those terms exist only
in the loss the causal LM's own `forward` assembles from `labels`. A trainer that computes the loss
from logits or hidden states itself — TRL's `SFTTrainer`, which calls the backbone directly under its
fused LM head, or `Trainer` with `compute_loss_func` or label smoothing, which call the causal LM without
labels — optimises the cross-entropy alone, and the router's compression drifts with nothing in the
logs to say so.

The signal: a training forward (module in training mode, gradients enabled) that will not assemble the
family's loss, i.e. the causal LM called without labels, or the backbone called other than by its causal
LM. Gradient-free forwards (evaluation, `ratio_step.plan_ratio_step`) never warn. One warning per model.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.utils import logging

logger = logging.get_logger(__name__)

# Passed by a causal LM to its backbone when the causal LM assembles the loss itself (labels given).
LOSS_IN_FORWARD = "_loss_in_forward"
TRAINERS = "hf_concept.training.ConceptTrainer (or hf_concept.training.sft.ConceptSFTTrainer for TRL)"


def warn_loss_terms_dropped(module: nn.Module, family: str, terms: list[str]) -> None:
    """Warn, once per `module`, that this training forward's loss leaves out the family's `terms`
    (nothing to say when `terms` is empty or the forward is gradient-free)."""
    if not terms or not (module.training and torch.is_grad_enabled()):
        return
    if getattr(module, "_warned_loss_terms_dropped", False):
        return
    module._warned_loss_terms_dropped = True
    logger.warning(
        f"{family}: a training forward ran without the model's own loss (no labels, or the backbone "
        "called directly, as TRL's SFTTrainer does with its fused LM head), so "
        f"{' and '.join(terms)} is not in the loss being optimised. Train with {TRAINERS}, or pass "
        "labels and optimise outputs.loss."
    )


def prior_loss_terms(config) -> list[str]:
    """LSLM's term beyond the cross-entropy: `kl_weight` · its prior term (the KL, or the binomial prior)."""
    if not config.kl_weight:
        return []
    return [f"the {getattr(config, 'prior_loss', 'kl')} prior term (kl_weight={config.kl_weight})"]
