"""The trainer a `train` run uses: `ConceptTrainer` with the atomic checkpoints and the stop at divergence of
`SafeCheckpointsMixin`, and DLCM's μP optimizer when asked."""

from __future__ import annotations

from typing import Any

import torch

from hf_concept.training.checkpoints import SafeCheckpointsMixin
from hf_concept.training.trainer import ConceptTrainer


class RecipeTrainer(SafeCheckpointsMixin, ConceptTrainer):
    """`ConceptTrainer` with atomic checkpoints and a stop at divergence (`SafeCheckpointsMixin`) that
    builds DLCM's μP optimizer when asked (after wrapping, as Trainer's own is)."""

    def __init__(self, *args: Any, mup_learning_rate: float | None = None, mup: bool = False, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.mup = mup
        self.mup_learning_rate = mup_learning_rate

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        if not self.mup or self.optimizer is not None:
            return super().create_optimizer(model)
        from hf_concept.training.mup import mup_optimizer

        rate = self.mup_learning_rate
        self.optimizer = mup_optimizer(
            self.model if model is None else model,
            token_lr=rate,
            concept_lr=rate,
            other_lr=rate,
            weight_decay=self.args.weight_decay,
            eps=self.args.adam_epsilon,
            betas=(self.args.adam_beta1, self.args.adam_beta2),
        )
        return self.optimizer
