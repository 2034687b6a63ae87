"""The learning rate of each step: warm-up, then constant, linear or cosine decay to a floor,
against hand-computed numbers."""

from __future__ import annotations

import math

import pytest

from flowrl.algorithms.lr_schedule import scheduled_lr


def test_warmup_rises_linearly_and_never_trains_at_zero() -> None:
    # four steps below the peak, which step 5 reaches
    rates = [scheduled_lr(1e-3, step, 10, "constant", warmup_steps=4) for step in range(1, 7)]
    assert rates == pytest.approx([2e-4, 4e-4, 6e-4, 8e-4, 1e-3, 1e-3])


def test_cosine_after_warmup_to_the_floor() -> None:
    # warm-up 2 (lr/3, 2 lr/3), the peak once at step 3, then the decay reaches 0.1 x lr at
    # step 7 (decay_steps 6: span 4, progress (step-3)/4)
    rates = [scheduled_lr(1e-3, step, 6, "cosine", warmup_steps=2, min_lr_ratio=0.1) for step in range(1, 9)]
    cosine = [0.5 * (1 + math.cos(math.pi * p)) for p in (0.0, 0.25, 0.5, 0.75, 1.0, 1.0)]
    expected = [1e-3 / 3, 2e-3 / 3] + [1e-3 * (0.1 + 0.9 * c) for c in cosine]
    assert rates == pytest.approx(expected)
    assert rates[3] == pytest.approx(0.868198e-3, rel=1e-6)  # 0.1 + 0.9 * 0.853553
    assert rates[-1] == pytest.approx(1e-4)  # past decay_steps: the floor


def test_linear_decay_without_warmup() -> None:
    rates = [scheduled_lr(2.0, step, 4, "linear") for step in range(1, 6)]
    assert rates == pytest.approx([2.0, 1.5, 1.0, 0.5, 0.0])


def test_steps_count_from_one_and_schedules_are_known() -> None:
    with pytest.raises(ValueError, match="from 1"):
        scheduled_lr(1.0, 0, 4)
    with pytest.raises(ValueError, match="constant, linear or cosine"):
        scheduled_lr(1.0, 2, 4, "step")  # type: ignore[arg-type]
