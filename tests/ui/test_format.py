"""Exact text of the number formats shared by the live view and the plain log."""

from __future__ import annotations

import math

import pytest

from flowrl.ui.format import (
    MISSING,
    format_duration,
    format_gb,
    format_ms,
    format_number,
    format_percent,
    format_seconds,
    format_tokens_per_s,
    sparkline,
)
from flowrl.ui.progress import EtaEstimator


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.031, "31ms"),
        (0.001, "1ms"),  # a whole number below 10 ms keeps no decimal
        (0.0004, "0.4ms"),  # a fast node must not read as 0ms
        (0.0015, "1.5ms"),
        (0.0, "0ms"),
        (1.2341, "1,234ms"),
        (None, MISSING),
        (math.nan, MISSING),
    ],
)
def test_format_ms(seconds: float | None, text: str) -> None:
    assert format_ms(seconds) == text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(65, "1m05s"), (9.4, "9s"), (0, "0s"), (-3, "0s"), (3600, "1h00m"), (3725, "1h02m"),
     (59.6, "1m00s"), (None, MISSING), (math.inf, MISSING)],
)
def test_format_duration(seconds: float | None, text: str) -> None:
    assert format_duration(seconds) == text


def test_format_other_units() -> None:
    assert format_seconds(0.084) == "0.084s"
    assert format_seconds(12.34) == "12.3s"
    assert format_tokens_per_s(1520.4) == "1,520 tok/s"
    assert format_tokens_per_s(None) == MISSING
    assert format_gb(1.234) == "1.2 GB"
    assert format_gb(10.0, 80.0) == "10.0 / 80.0 GB"
    assert format_percent(0.374) == "37%"
    assert format_percent(1.0) == "100%"
    assert format_number(0.4061) == "0.41"
    assert format_number(16.0, 1) == "16.0"
    assert format_number(1e30) == "1.00e+30" and format_number(-2.5e6, 1) == "-2.5e+06"  # not 31 digits


def test_sparkline_scales_between_min_and_max() -> None:
    # levels 0..7; (v - 0) / 1 * 7 -> 0, 3.5 -> 4 (half to even), 7
    assert sparkline([0.0, 0.5, 1.0]) == "▁▅█"
    assert sparkline([0.3, 0.3]) == "▁▁"
    assert sparkline([]) == ""
    # only the last `width` values are drawn
    assert sparkline([5.0, 0.0, 1.0], width=2) == "▁█"


def test_eta_uses_recent_window() -> None:
    eta = EtaEstimator(window_steps=2)
    assert eta.eta_s(10) is None
    eta.add(1, 5.0)  # warm-up step: 5 s
    # one mark: 5.0 s / 1 step * 9 steps left = 45 s
    assert eta.eta_s(10) == pytest.approx(45.0)
    eta.add(2, 6.0)
    eta.add(3, 7.0)
    # window of 2 steps: marks (1, 5.0) .. (3, 7.0) -> 1 s/step, 7 left -> 7 s, 2 s already spent
    assert eta.eta_s(10, since_last_step_s=2.0) == pytest.approx(5.0)
    eta.add(10, 14.0)
    assert eta.eta_s(10) == 0.0


def test_eta_restarts_on_repeated_step() -> None:
    eta = EtaEstimator()
    eta.add(4, 40.0)
    eta.add(5, 50.0)
    eta.add(5, 52.0)  # replayed from an older snapshot after a lost worker
    # one mark after a replay says nothing of a step's time (52 s / 5 steps counts steps 1-5
    # twice): unknown until the next step
    assert eta.eta_s(10) is None
    eta.add(6, 62.0)
    assert eta.eta_s(10) == pytest.approx(40.0)


def test_eta_of_a_resumed_run_counts_only_the_steps_this_process_ran() -> None:
    eta = EtaEstimator()
    eta.add(51, 6.0, first_step=51)  # resumed after step 50's checkpoint: one step in 6 s
    # 6 s / 1 step (not 6 s / 51 steps) x 49 left
    assert eta.eta_s(100) == pytest.approx(294.0)
