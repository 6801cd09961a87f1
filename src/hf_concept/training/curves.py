"""The curves of a `train` run as a PNG, read from Trainer's `log_history`: the training loss (and the
evaluation loss, where evaluated) and, for the families that compress, the realised compression, over the
optimizer steps.

matplotlib is optional (the `plots` extra: `pip install 'hf_concept[plots]'`): without it nothing is
drawn, `write_training_curves` returns None and logs one line saying so; training never needs it. It is
drawn with the Figure API (no pyplot): no global backend switch, no figure left open.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger("hf_concept.train")

CURVES_NAME = "training_curves.png"
# (log key, legend) of the compression curves; Hidden Decoding and plain models log none of them.
COMPRESSION_CURVES = (
    ("inference_compression_ratio", "inference (thresholded boundaries)"),
    ("compression_ratio", "training (sampled boundaries)"),
    ("eval_compression_ratio", "evaluation"),
)


def logged_curve(log_history: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the log entries that hold `key`, in logging order."""
    points = [
        (int(entry["step"]), float(entry[key])) for entry in log_history if key in entry and "step" in entry
    ]
    return [step for step, _ in points], [value for _, value in points]


def write_training_curves(log_history: list[dict[str, Any]], path: str | Path) -> Path | None:
    """Draw the run's loss and compression curves into `path` (PNG) and return it; None, with one logged
    line saying why, when the run logged no training loss or matplotlib is not installed."""
    path = Path(path)
    steps, losses = logged_curve(log_history, "loss")
    if not steps:
        logger.info(f"no training loss was logged (no logging step in the run): no {path}")
        return None
    try:
        from matplotlib.figure import Figure
    except ImportError:
        logger.info(f"matplotlib is not installed (pip install 'hf_concept[plots]'): no {path}")
        return None
    compression = [(label, *logged_curve(log_history, key)) for key, label in COMPRESSION_CURVES]
    compression = [curve for curve in compression if curve[1]]
    figure = Figure(figsize=(11 if compression else 6, 4))
    axes = figure.subplots(1, 2 if compression else 1, squeeze=False)[0]
    axes[0].plot(steps, losses, label="training loss")
    eval_steps, eval_losses = logged_curve(log_history, "eval_loss")
    if eval_steps:
        axes[0].plot(eval_steps, eval_losses, marker="o", label="evaluation loss")
    axes[0].set(title="loss", xlabel="optimizer step")
    axes[0].legend()
    if compression:
        for label, curve_steps, values in compression:
            axes[1].plot(curve_steps, values, marker="." if len(values) < 20 else None, label=label)
        axes[1].set(
            title="realised compression",
            xlabel="optimizer step",
            ylabel="tokens per concept (LSLM: bytes per segment)",
        )
        axes[1].legend()
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=100)
    return path
