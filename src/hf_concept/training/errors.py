"""The errors `train` raises for problems a user can act on (the CLI prints each as one line)."""

from __future__ import annotations


class TrainSetupError(ValueError):
    """A user input problem found before training starts (the CLI prints it as one line, exit status 2)."""


class TrainingDivergedError(RuntimeError):
    """Training produced a non-finite loss, gradient norm or weight; nothing non-finite was saved
    (the CLI prints it as one line, exit status 1)."""
