"""Batch shares of a node split over devices, from the devices' measured speed.

A part that took ``t_r`` seconds for share ``s_r`` of the rows runs at ``s_r / t_r``; giving
each part a share proportional to that speed makes all parts finish together, so a fast card
does not wait for a slow one at the join (or at a data-parallel update's all-reduce).
"""

from __future__ import annotations

from collections.abc import Sequence

MIN_CHANGE = 0.05
"""Shares are changed only when one moves by at least this much (absolute): smaller changes
are noise and would only churn."""


MIN_SHARE = 0.05
"""No part gets less than this share: a part without rows could not be measured again."""


def balanced_shares(shares: Sequence[float], compute_s: Sequence[float]) -> tuple[float, ...]:
    """New shares (summing to 1) proportional to each part's measured speed; unchanged when
    a part has no measured time."""
    total = sum(shares)
    if any(seconds <= 0 for seconds in compute_s):
        return tuple(share / total for share in shares)
    speeds = [(share / total) / seconds for share, seconds in zip(shares, compute_s)]
    new = [max(MIN_SHARE, speed / sum(speeds)) for speed in speeds]
    return tuple(share / sum(new) for share in new)


def rebalanced(shares: Sequence[float], compute_s: Sequence[float]) -> tuple[float, ...] | None:
    """``balanced_shares``, or None when no share moves by ``MIN_CHANGE``."""
    total = sum(shares)
    new = balanced_shares(shares, compute_s)
    if max(abs(a - b / total) for a, b in zip(new, shares)) < MIN_CHANGE:
        return None
    return new
