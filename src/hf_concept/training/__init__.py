"""Training helpers: Trainer integration, optimizer factories, schedules."""

from hf_concept.training.checkpoints import checkpoint_problems, latest_checkpoint
from hf_concept.training.errors import TrainingDivergedError, TrainSetupError
from hf_concept.training.mup import MUP_GROUPS, mup_optimizer, mup_param_groups
from hf_concept.training.ratio_hold import RatioHold
from hf_concept.training.recipes import LORA_ATTENTION as LORA_ATTENTION_TARGETS
from hf_concept.training.recipes import LORA_EXPERT_TARGETS, TrainResult, train
from hf_concept.training.trainer import METRIC_FIELDS, ConceptTrainer

__all__ = [
    "LORA_ATTENTION_TARGETS",
    "LORA_EXPERT_TARGETS",
    "METRIC_FIELDS",
    "MUP_GROUPS",
    "ConceptTrainer",
    "RatioHold",
    "TrainResult",
    "TrainSetupError",
    "TrainingDivergedError",
    "checkpoint_problems",
    "latest_checkpoint",
    "mup_optimizer",
    "mup_param_groups",
    "train",
]
