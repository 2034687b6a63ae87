"""GRPO advantages on hand-computed rewards."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.algorithms.advantages import ADVANTAGE_ESTIMATORS, grpo_advantages


def test_two_groups_of_four_hand_computed() -> None:
    # Group 0 = [1, 0, 0, 1]: mean 0.5, deviations +-0.5.
    #   unbiased variance = (4 * 0.25) / (4 - 1) = 1/3, std = 1/sqrt(3) = 0.577350
    #   advantage = +-0.5 / (1/sqrt(3)) = +-sqrt(3)/2 = +-0.866025  (epsilon = 0 here)
    # Group 1 = [2, 2, 2, 2]: every deviation is 0 -> 0 / (0 + eps) = 0, no signal.
    # TRL's GRPOTrainer (scale_rewards="group") uses the same Bessel-corrected std.
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    half_root3 = math.sqrt(3) / 2
    expected = torch.tensor([half_root3, -half_root3, -half_root3, half_root3, 0, 0, 0, 0])
    advantages = grpo_advantages(rewards, group_size=4, epsilon=0.0)
    torch.testing.assert_close(advantages, expected)


def test_epsilon_is_added_to_the_std() -> None:
    # Same group 0 with epsilon = 1e-6: 0.5 / (0.5773503 + 1e-6) = 0.8660239
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    advantages = grpo_advantages(rewards, group_size=4)
    assert advantages[0].item() == pytest.approx(0.5 / (1 / math.sqrt(3) + 1e-6), rel=1e-6)
    assert advantages[4:].abs().max().item() == 0.0


def test_group_of_two() -> None:
    # [3, 1]: mean 2, unbiased std = sqrt((1 + 1) / 1) = sqrt(2) -> +-1/sqrt(2) = +-0.707107
    advantages = grpo_advantages(torch.tensor([3.0, 1.0]), group_size=2, epsilon=0.0)
    torch.testing.assert_close(advantages, torch.tensor([1 / math.sqrt(2), -1 / math.sqrt(2)]))


def test_without_std_scaling_only_the_mean_is_subtracted() -> None:
    # Group means 0.5 and 2 -> [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    advantages = grpo_advantages(rewards, group_size=4, scale_by_std=False)
    torch.testing.assert_close(advantages, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))


def test_group_of_one_has_zero_advantage() -> None:
    # Each reward is its own group mean; no std of one sample is taken (no NaN).
    advantages = grpo_advantages(torch.tensor([0.3, 5.0]), group_size=1)
    torch.testing.assert_close(advantages, torch.zeros(2))


def test_integer_rewards_and_no_gradient_into_rewards() -> None:
    rewards = torch.tensor([1, 0], dtype=torch.int64)
    advantages = grpo_advantages(rewards, group_size=2, scale_by_std=False)
    assert advantages.dtype == torch.float32
    torch.testing.assert_close(advantages, torch.tensor([0.5, -0.5]))
    learned = torch.tensor([1.0, 0.0], requires_grad=True)
    assert not grpo_advantages(learned, group_size=2).requires_grad


def test_rewards_not_divisible_into_groups() -> None:
    with pytest.raises(ValueError, match="cannot be split into groups of 4"):
        grpo_advantages(torch.zeros(6), group_size=4)


def test_bad_shapes_and_group_size() -> None:
    with pytest.raises(ValueError, match=r"shape \[N\]"):
        grpo_advantages(torch.zeros(2, 2), group_size=2)
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(torch.zeros(2), group_size=0)


def test_registry() -> None:
    assert ADVANTAGE_ESTIMATORS["grpo"] is grpo_advantages
