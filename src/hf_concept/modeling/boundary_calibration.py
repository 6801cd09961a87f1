"""The inference threshold that closes segments at the rate training samples them (LSLM, see
`LSLMConfig`'s docstring): a window of recent training posteriors q_t and the quantile that splits it.

Training closes byte t with probability q_t (a Gumbel-sigmoid sample thresholded at ½), so over a window
of bytes it closes a share r = mean(q). Inference thresholds q_t; the threshold τ that closes the same
share of the same bytes is the (1 − r) quantile of the window. The window is the model's own (not saved
with the weights); the threshold it gives is written into the config, which is.
"""

from __future__ import annotations

import torch

WINDOW = 65536
# The config requires a threshold strictly inside (0, 1).
EDGE = 1e-6


def rate_matching_threshold(probs: torch.Tensor) -> float:
    """τ with share(q ≥ τ) ≈ mean(q) over the 1-D `probs`: their (1 − mean) quantile, kept in (0, 1)."""
    probs = probs.detach().float().flatten()
    if probs.numel() == 0:
        raise ValueError("rate_matching_threshold needs at least one probability")
    rate = float(probs.mean())
    tau = float(torch.quantile(probs, min(max(1.0 - rate, 0.0), 1.0)))
    return min(max(tau, EDGE), 1.0 - EDGE)


class BoundaryCalibration:
    """A ring of the last `window` free bytes' q_t (float32, on the CPU) and its rate-matching threshold."""

    def __init__(self, window: int = WINDOW) -> None:
        self.window = window
        # Made at the first observation: a model built under `from_pretrained` is on the meta device.
        self.values: torch.Tensor | None = None
        self.filled = 0
        self.cursor = 0

    def observe(self, probs: torch.Tensor) -> None:
        """Add the 1-D `probs` (the newest `window` of them when more)."""
        probs = probs.detach().float().flatten()[-self.window :].cpu()
        if self.values is None:
            self.values = torch.empty(self.window, device="cpu")
        count = probs.numel()
        end = self.cursor + count
        if end <= self.window:
            self.values[self.cursor : end] = probs
        else:
            split = self.window - self.cursor
            self.values[self.cursor :] = probs[:split]
            self.values[: count - split] = probs[split:]
        self.cursor = end % self.window
        self.filled = min(self.filled + count, self.window)

    def threshold(self) -> float | None:
        """The rate-matching threshold of the window; None before any observation."""
        if self.values is None or not self.filled:
            return None
        return rate_matching_threshold(self.values[: self.filled])
