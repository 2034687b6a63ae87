"""Short, fixed formats for the numbers a run reports.

Every function is pure and returns plain text, so the live view and the plain log
print the same figure the same way (``31ms``, ``1,520 tok/s``, ``1m05s``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

SPARK_LEVELS = "▁▂▃▄▅▆▇█"
"""Eight block heights, lowest first, used by :func:`sparkline`."""

MISSING = "-"
"""Shown where a number is not known yet (no step finished, metric not reported)."""


def _is_missing(value: float | None) -> bool:
    return value is None or math.isnan(value)


def format_ms(seconds: float | None) -> str:
    """Seconds as milliseconds: ``0.031 -> "31ms"``, ``0.0004 -> "0.4ms"``.

    Below 10 ms one decimal is kept, because a fast node (score, advantage) would
    otherwise read as ``0ms``.
    """
    if _is_missing(seconds):
        return MISSING
    assert seconds is not None
    milliseconds = seconds * 1000.0
    if milliseconds < 10.0 and round(milliseconds, 1) != round(milliseconds):
        return f"{milliseconds:.1f}ms"
    return f"{milliseconds:,.0f}ms"


def format_seconds(seconds: float | None) -> str:
    """A step time in seconds: ``0.084 -> "0.084s"``, ``12.34 -> "12.3s"``."""
    if _is_missing(seconds):
        return MISSING
    assert seconds is not None
    if seconds < 10.0:
        return f"{seconds:.3f}s"
    return f"{seconds:,.1f}s"


def format_tokens_per_s(tokens_per_s: float | None) -> str:
    """A throughput with thousands separators: ``1520.4 -> "1,520 tok/s"``."""
    if _is_missing(tokens_per_s):
        return MISSING
    assert tokens_per_s is not None
    return f"{tokens_per_s:,.0f} tok/s"


def format_gb(memory_gb: float | None, total_gb: float | None = None) -> str:
    """Memory in GB, with the device total when known: ``"1.2 / 80.0 GB"``."""
    if _is_missing(memory_gb):
        return MISSING
    assert memory_gb is not None
    if _is_missing(total_gb):
        return f"{memory_gb:.1f} GB"
    return f"{memory_gb:.1f} / {total_gb:.1f} GB"


def format_percent(fraction: float | None) -> str:
    """A fraction in [0, 1] as a whole percentage: ``0.374 -> "37%"``."""
    if _is_missing(fraction):
        return MISSING
    assert fraction is not None
    return f"{fraction * 100.0:.0f}%"


def format_duration(seconds: float | None) -> str:
    """A duration for elapsed and ETA: ``9 -> "9s"``, ``65 -> "1m05s"``, ``3725 -> "1h02m"``.

    Rounded to whole seconds; hours drop the seconds, which no one reads in an ETA.
    """
    if _is_missing(seconds) or (seconds is not None and math.isinf(seconds)):
        return MISSING
    assert seconds is not None
    total_s = max(0, int(round(seconds)))
    hours, rest_s = divmod(total_s, 3600)
    minutes, secs = divmod(rest_s, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def format_number(value: float | None, decimals: int = 2) -> str:
    """A metric with a fixed number of decimals: ``0.4061 -> "0.41"``; from 1e6 on in
    scientific notation (``1e30`` from a reward function would fill the line with digits)."""
    if _is_missing(value):
        return MISSING
    assert value is not None
    if abs(value) >= 1e6:
        return f"{value:.{decimals}e}"
    return f"{value:.{decimals}f}"


def sparkline(values: Sequence[float], width: int = 20) -> str:
    """The last ``width`` values as block characters scaled between their min and max.

    A flat series draws at the lowest level, so a constant reward reads as flat
    rather than as full.
    """
    recent = [value for value in values if not math.isnan(value)][-width:]
    if not recent:
        return ""
    low, high = min(recent), max(recent)
    span = high - low
    top = len(SPARK_LEVELS) - 1
    if span == 0:
        return SPARK_LEVELS[0] * len(recent)
    return "".join(SPARK_LEVELS[round((value - low) / span * top)] for value in recent)
