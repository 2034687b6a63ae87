"""GRPO and RLOO advantages on hand-computed rewards, and the estimator registry.

TRL 1.16 computes the RLOO baseline inline in ``RLOOTrainer._generate_and_score_completions``
(no importable function), so RLOO is checked by hand and against a plain leave-one-out loop.
"""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    AdvantageSettings,
    grpo_advantages,
    rloo_advantages,
)
from flowrl.algorithms.token_advantages import (
    gae_advantages,
    reinforce_pp_advantages,
    sequence_reward_to_tokens,
)

NAN = float("nan")


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


# -- RLOO ---------------------------------------------------------------------------------


def test_rloo_hand_computed() -> None:
    # Group [1, 0, 0, 1] (k = 4, sum 2): baseline of a 1 = (2 - 1) / 3 = 1/3 -> A = +2/3;
    #   baseline of a 0 = (2 - 0) / 3 = 2/3 -> A = -2/3.  (= k/(k-1) * (r - mean) = 4/3 * +-0.5)
    # Group [2, 2, 2, 2]: every baseline is 2 -> A = 0.
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    expected = torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0])
    torch.testing.assert_close(rloo_advantages(rewards, group_size=4), expected)
    # Group [0.5, 1, 3] (k = 3, sum 4.5): A = 0.5 - 4/2 = -1.5, 1 - 3.5/2 = -0.75, 3 - 1.5/2 = 2.25
    advantages = rloo_advantages(torch.tensor([0.5, 1.0, 3.0]), group_size=3)
    torch.testing.assert_close(advantages, torch.tensor([-1.5, -0.75, 2.25]))


def test_rloo_matches_a_leave_one_out_loop() -> None:
    # Plain loop: mean of the other k - 1 samples of the group, one sample at a time.
    generator = torch.Generator().manual_seed(3)
    group_size = 5
    rewards = torch.randn(4 * group_size, generator=generator)
    expected = torch.empty_like(rewards)
    for i in range(rewards.shape[0]):
        start = i - i % group_size
        others = [rewards[j].item() for j in range(start, start + group_size) if j != i]
        expected[i] = rewards[i].item() - sum(others) / len(others)
    torch.testing.assert_close(rloo_advantages(rewards, group_size), expected)
    # RLOO is GRPO without std scaling, stretched by k / (k - 1).
    dr_grpo = grpo_advantages(rewards, group_size, scale_by_std=False)
    torch.testing.assert_close(rloo_advantages(rewards, group_size), dr_grpo * 5 / 4)


def test_rloo_errors() -> None:
    with pytest.raises(ValueError, match="at least 2 samples per prompt"):
        rloo_advantages(torch.zeros(4), group_size=1)
    with pytest.raises(ValueError, match="cannot be split into groups of 4"):
        rloo_advantages(torch.zeros(6), group_size=4)
    with pytest.raises(ValueError, match=r"shape \[N\]"):
        rloo_advantages(torch.zeros(2, 2), group_size=2)


# -- registry: one calling convention ------------------------------------------------------


def test_registry_names() -> None:
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "rloo", "gae", "reinforce_pp"}


def _inputs(**overrides: object) -> AdvantageInputs:
    """Two prompts x two completions; completion lengths 2, 1, 2, 2 padded to 2."""
    fields: dict[str, object] = {
        "scores": torch.tensor([1.0, 0.0, 0.5, 0.5]),
        "group_size": 2,
        "mask": torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]]),
        "values": torch.tensor([[0.2, 0.4], [0.1, NAN], [0.3, 0.3], [0.0, 0.6]]),
        "kl": torch.tensor([[0.2, 0.4], [1.0, NAN], [0.0, 0.0], [0.2, 0.2]]),
        "kl_coef": 0.0,
    }
    fields.update(overrides)
    return AdvantageInputs(**fields)  # type: ignore[arg-type]


def test_registry_grpo_and_rloo_without_kl() -> None:
    inputs, settings = _inputs(), AdvantageSettings(epsilon=0.0)
    # groups [1, 0] and [0.5, 0.5]: grpo -> +-1/sqrt(2) and 0; rloo -> +-1 and 0
    grpo = ADVANTAGE_ESTIMATORS["grpo"](inputs, settings)
    torch.testing.assert_close(grpo.advantages, grpo_advantages(inputs.scores, 2, epsilon=0.0))
    assert grpo.returns is None
    rloo = ADVANTAGE_ESTIMATORS["rloo"](inputs, settings)
    torch.testing.assert_close(rloo.advantages, torch.tensor([1.0, -1.0, 0.0, 0.0]))


def test_registry_sequence_estimators_subtract_the_summed_kl() -> None:
    # kl_coef 0.5, summed KL per row (padding NaN left out) = [0.6, 1.0, 0.0, 0.4]
    # penalised scores = [1 - 0.3, 0 - 0.5, 0.5 - 0, 0.5 - 0.2] = [0.7, -0.5, 0.5, 0.3]
    # rloo: group [0.7, -0.5] -> +-1.2; group [0.5, 0.3] -> +-0.2
    # (TRL's RLOOTrainer subtracts beta * the summed per-token KL from the reward the same way)
    inputs = _inputs(kl_coef=0.5)
    rloo = ADVANTAGE_ESTIMATORS["rloo"](inputs, AdvantageSettings())
    torch.testing.assert_close(rloo.advantages, torch.tensor([1.2, -1.2, 0.2, -0.2]))
    grpo = ADVANTAGE_ESTIMATORS["grpo"](inputs, AdvantageSettings(scale_by_std=False))
    torch.testing.assert_close(grpo.advantages, torch.tensor([0.6, -0.6, 0.1, -0.1]))


def test_registry_token_estimators_use_kl_as_token_reward() -> None:
    inputs = _inputs(kl_coef=0.5)
    settings = AdvantageSettings(gamma=0.9, lam=0.8, whiten=False)
    assert inputs.mask is not None and inputs.values is not None
    token_rewards = sequence_reward_to_tokens(inputs.scores, inputs.mask, inputs.kl, 0.5)
    # row 0: [-0.1, -0.2 + 1] = [-0.1, 0.8]; row 1: [-0.5 + 0, 0]
    torch.testing.assert_close(token_rewards[:2], torch.tensor([[-0.1, 0.8], [-0.5, 0.0]]))
    gae = ADVANTAGE_ESTIMATORS["gae"](inputs, settings)
    expected_advantages, expected_returns = gae_advantages(
        token_rewards, inputs.values, inputs.mask, gamma=0.9, lam=0.8, whiten=False
    )
    torch.testing.assert_close(gae.advantages, expected_advantages)
    assert gae.returns is not None
    torch.testing.assert_close(gae.returns, expected_returns)
    reinforce_pp = ADVANTAGE_ESTIMATORS["reinforce_pp"](inputs, settings)
    expected = reinforce_pp_advantages(token_rewards, inputs.mask, gamma=0.9)
    torch.testing.assert_close(reinforce_pp.advantages, expected)
    assert reinforce_pp.returns is None


def test_registry_names_a_missing_input() -> None:
    with pytest.raises(ValueError, match="'gae' needs values"):
        ADVANTAGE_ESTIMATORS["gae"](_inputs(values=None), AdvantageSettings())
    with pytest.raises(ValueError, match="'reinforce_pp' needs mask"):
        ADVANTAGE_ESTIMATORS["reinforce_pp"](_inputs(mask=None), AdvantageSettings())
    with pytest.raises(ValueError, match="lam must be in"):
        AdvantageSettings(lam=-0.1)
