"""Training helpers: Trainer integration, optimizer factories, schedules."""

from hf_concept.training.trainer import METRIC_FIELDS, ConceptTrainer

__all__ = ["METRIC_FIELDS", "ConceptTrainer"]
