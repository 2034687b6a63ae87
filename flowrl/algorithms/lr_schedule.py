"""The learning rate of each training step: a linear warm-up, then constant, linear or cosine
decay towards a floor.

A pure function of the step number (no scheduler state), so a resumed run, a run recovered
mid-step and every rank of a data-parallel update take the rate an uninterrupted run would.
"""

from __future__ import annotations

import math
from typing import Literal

LrSchedule = Literal["constant", "linear", "cosine"]


def scheduled_lr(
    lr: float,
    step: int,
    decay_steps: int,
    schedule: LrSchedule = "constant",
    warmup_steps: int = 0,
    min_lr_ratio: float = 0.0,
) -> float:
    """The rate of training step ``step`` (1-based).

    Steps ``1..warmup_steps`` rise linearly towards ``lr`` (step k takes
    ``lr * k / (warmup_steps + 1)``: no step trains at rate 0, and the peak comes once, at the
    first step after the warm-up). From there ``constant`` keeps ``lr``; ``linear`` and
    ``cosine`` decay from ``lr`` towards ``min_lr_ratio * lr``, which the step after
    ``decay_steps`` reaches and the steps after it keep.
    """
    if step < 1:
        raise ValueError(f"steps count from 1, got {step}")
    if step <= warmup_steps:
        return lr * step / (warmup_steps + 1)
    if schedule == "constant":
        return lr
    span = max(1, decay_steps - warmup_steps)
    progress = min(1.0, (step - 1 - warmup_steps) / span)
    if schedule == "linear":
        factor = 1.0 - progress
    elif schedule == "cosine":
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown lr schedule {schedule!r}; expected constant, linear or cosine")
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * factor)
