"""Exponentially weighted moving averages, configured by a window in samples."""

from __future__ import annotations

from dataclasses import dataclass


def alpha_for_window(window: int) -> float:
    """The weight of the newest sample for a window of ``window`` samples: 2 / (window + 1).

    With that weight the average's centre of mass lies as many samples back as a plain
    mean over ``window`` samples (the usual "span" convention); window 1 keeps only the
    newest sample.
    """
    if window < 1:
        raise ValueError(f"an EWMA window must be at least 1 sample, got {window}")
    return 2.0 / (window + 1)


@dataclass
class Ewma:
    alpha: float
    value: float | None = None

    def update(self, sample: float) -> float:
        self.value = sample if self.value is None else self.value + self.alpha * (sample - self.value)
        return self.value
