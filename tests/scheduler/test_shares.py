"""Row shares of split nodes follow measured speed."""

from __future__ import annotations

import pytest

from flowrl.scheduler.shares import balanced_shares, rebalanced


def test_shares_follow_speed_so_parts_finish_together() -> None:
    # equal halves; part 0 took 30 ms, part 1 60 ms: part 0 is twice as fast -> 2/3 : 1/3
    assert balanced_shares([1.0, 1.0], [0.030, 0.060]) == pytest.approx((2 / 3, 1 / 3))
    # then with 2/3 : 1/3 both take 40 ms: balanced, nothing changes
    assert balanced_shares([2 / 3, 1 / 3], [0.040, 0.040]) == pytest.approx((2 / 3, 1 / 3))
    # 3:1 taking 30 and 10 ms: the same speed, so halves (both then take 20 ms)
    assert balanced_shares([3.0, 1.0], [0.030, 0.010]) == pytest.approx((0.5, 0.5))


def test_small_changes_are_left_alone() -> None:
    assert rebalanced([1.0, 1.0], [0.030, 0.031]) is None  # 50.8 % vs 50 %: noise
    assert rebalanced([1.0, 1.0], [0.030, 0.060]) == pytest.approx((2 / 3, 1 / 3))


def test_a_part_without_a_time_keeps_its_share_and_no_part_is_starved() -> None:
    assert balanced_shares([1.0, 1.0], [0.030, 0.0]) == pytest.approx((0.5, 0.5))
    # 100x slower: 1/101 of the rows, raised to 5 % so it keeps being measured
    fast, slow = balanced_shares([1.0, 1.0], [0.010, 1.0])
    assert slow == pytest.approx(0.05 / (0.05 + 100 / 101))
