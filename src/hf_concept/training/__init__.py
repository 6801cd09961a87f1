"""Training helpers: Trainer integration, optimizer factories, schedules.

The names below load on first use (PEP 562): `hf-concept` builds every command's parser at start, and the
train command's options (`hf_concept.training.options`) must not pull torch and transformers in with them.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> (module under hf_concept.training, its name there)
_EXPORTS = {
    "checkpoint_problems": ("checkpoints", "checkpoint_problems"),
    "latest_checkpoint": ("checkpoints", "latest_checkpoint"),
    "TrainingDivergedError": ("errors", "TrainingDivergedError"),
    "TrainSetupError": ("errors", "TrainSetupError"),
    "MUP_GROUPS": ("mup", "MUP_GROUPS"),
    "mup_optimizer": ("mup", "mup_optimizer"),
    "mup_param_groups": ("mup", "mup_param_groups"),
    "RatioHold": ("ratio_hold", "RatioHold"),
    "LORA_ATTENTION_TARGETS": ("recipes", "LORA_ATTENTION"),
    "LORA_EXPERT_TARGETS": ("recipes", "LORA_EXPERT_TARGETS"),
    "TrainResult": ("recipes", "TrainResult"),
    "train": ("recipes", "train"),
    "METRIC_FIELDS": ("trainer", "METRIC_FIELDS"),
    "ConceptTrainer": ("trainer", "ConceptTrainer"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hf_concept.training' has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    value = getattr(importlib.import_module(f"hf_concept.training.{module}"), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
