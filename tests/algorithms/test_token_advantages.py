"""GAE, REINFORCE++, token rewards and masked whitening on hand-computed tensors.

TRL 1.16 has no PPO trainer any more (not in ``trl`` nor ``trl.experimental``), so it exposes
no GAE loop, no ``masked_whiten`` and no ``compute_rewards`` to import; GAE is checked against
a plain Python loop instead. The one TRL function that computes a masked statistic here,
``trl.trainer.utils.nanstd`` (Bessel-corrected std ignoring NaN, used by its GRPO and RLOO
trainers), is compared with :func:`masked_whiten` below.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from flowrl.algorithms.token_advantages import (
    discounted_returns,
    gae_advantages,
    masked_whiten,
    reinforce_pp_advantages,
    sequence_reward_to_tokens,
)

NAN = float("nan")


# -- sequence_reward_to_tokens ------------------------------------------------------------


def test_score_on_last_token_minus_kl_on_every_token() -> None:
    # kl_coef = 0.1, r_t = -0.1 * kl_t, plus the score on the last counted token:
    #   row 0 (3 tokens), score 1: [-0.01, -0.02, -0.03 + 1] = [-0.01, -0.02, 0.97]
    #   row 1 (1 token),  score 2: [-0.05 + 2, 0, 0]         = [1.95, 0, 0]  (NaN KL on padding)
    #   row 2 (no token), score 5: nothing to credit          = [0, 0, 0]
    scores = torch.tensor([1.0, 2.0, 5.0])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, NAN, NAN], [NAN, NAN, NAN]])
    rewards = sequence_reward_to_tokens(scores, mask, kl, kl_coef=0.1)
    expected = torch.tensor([[-0.01, -0.02, 0.97], [1.95, 0.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(rewards, expected)


def test_without_kl_only_the_score_is_placed() -> None:
    rewards = sequence_reward_to_tokens(torch.tensor([3.0, -1.0]), torch.tensor([[1, 1], [1, 0]]))
    torch.testing.assert_close(rewards, torch.tensor([[0.0, 3.0], [-1.0, 0.0]]))


# -- masked_whiten ------------------------------------------------------------------------


def test_masked_whiten_hand_computed() -> None:
    # Unmasked values 1, 2, 3, 5: mean 2.75, deviations -1.75, -0.75, 0.25, 2.25,
    # squares sum 3.0625 + 0.5625 + 0.0625 + 5.0625 = 8.75.
    #   unbiased var = 8.75 / 3 (TRL's masked_var / nanstd), biased var = 8.75 / 4 (OpenRLHF)
    x = torch.tensor([[1.0, 2.0, 3.0], [5.0, NAN, NAN]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    deviations = torch.tensor([[-1.75, -0.75, 0.25], [2.25, 0.0, 0.0]])
    unbiased = masked_whiten(x, mask, epsilon=0.0)
    torch.testing.assert_close(unbiased, deviations / math.sqrt(8.75 / 3))
    biased = masked_whiten(x, mask, unbiased=False, epsilon=0.0)
    torch.testing.assert_close(biased, deviations / math.sqrt(8.75 / 4))
    # shift_mean=False adds the mean 2.75 back on the counted positions only.
    kept_mean = masked_whiten(x, mask, shift_mean=False, epsilon=0.0)
    torch.testing.assert_close(kept_mean, unbiased + 2.75 * mask)


def test_masked_whiten_degenerate_batches() -> None:
    # One token or a constant batch: nothing to scale, the result is 0 (not NaN or inf).
    one = masked_whiten(torch.tensor([[4.0, NAN]]), torch.tensor([[1, 0]]))
    torch.testing.assert_close(one, torch.zeros(1, 2))
    constant = masked_whiten(torch.full((2, 2), 3.0), torch.ones(2, 2))
    torch.testing.assert_close(constant, torch.zeros(2, 2))
    empty = masked_whiten(torch.ones(2, 2), torch.zeros(2, 2))
    torch.testing.assert_close(empty, torch.zeros(2, 2))


def test_masked_whiten_matches_trl_nanstd() -> None:
    # TRL function compared: trl.trainer.utils.nanstd (unbiased std over the non-NaN entries),
    # with padding written as NaN. (x - nanmean) / nanstd must equal our unbiased whitening.
    trl_utils = pytest.importorskip("trl.trainer.utils")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 9, generator=generator) * 3 + 1
    lengths = torch.tensor([9, 1, 4, 7, 2, 5])
    mask = torch.arange(9).unsqueeze(0) < lengths.unsqueeze(1)
    with_nan = torch.where(mask, x, torch.full_like(x, NAN))
    trl_whitened = (with_nan - torch.nanmean(with_nan)) / trl_utils.nanstd(with_nan)
    ours = masked_whiten(x, mask, epsilon=0.0)
    torch.testing.assert_close(ours[mask], trl_whitened[mask])


# -- discounted returns and GAE -----------------------------------------------------------


def test_discounted_returns_hand_computed() -> None:
    # gamma = 0.5, row 0 r = [0.1, 0, 1]: G2 = 1, G1 = 0 + 0.5 * 1 = 0.5, G0 = 0.1 + 0.25 = 0.35
    # row 1 r = [2] then padding (NaN): G0 = 2
    rewards = torch.tensor([[0.1, 0.0, 1.0], [2.0, NAN, NAN]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    returns = discounted_returns(rewards, mask, gamma=0.5)
    torch.testing.assert_close(returns, torch.tensor([[0.35, 0.5, 1.0], [2.0, 0.0, 0.0]]))


def _gae_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three rows of lengths 3, 2 and 1 padded to 3; padding holds junk (NaN, 100)."""
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.5, -1.0, NAN], [2.0, NAN, 7.0]])
    values = torch.tensor([[0.5, 0.6, 0.8], [0.2, 0.4, 100.0], [1.5, 100.0, NAN]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]])
    return rewards, values, mask


def test_gae_hand_computed_with_episode_ends() -> None:
    # gamma = 0.9, lam = 0.5 (gamma * lam = 0.45); V after each row's last token is 0.
    # delta_t = r_t + 0.9 * V_{t+1} - V_t,  A_t = delta_t + 0.45 * A_{t+1},  R_t = A_t + V_t
    # row 0, r = [0, 0, 1], V = [0.5, 0.6, 0.8]:
    #   t=2: delta = 1 + 0 - 0.8 = 0.2                        A2 = 0.2
    #   t=1: delta = 0 + 0.9 * 0.8 - 0.6 = 0.12               A1 = 0.12 + 0.45 * 0.2  = 0.21
    #   t=0: delta = 0 + 0.9 * 0.6 - 0.5 = 0.04               A0 = 0.04 + 0.45 * 0.21 = 0.1345
    #   returns = [0.6345, 0.81, 1.0]
    # row 1, r = [0.5, -1], V = [0.2, 0.4] (the 100 on padding must not be bootstrapped):
    #   t=1: delta = -1 + 0 - 0.4 = -1.4                      A1 = -1.4
    #   t=0: delta = 0.5 + 0.9 * 0.4 - 0.2 = 0.66             A0 = 0.66 + 0.45 * -1.4 = 0.03
    #   returns = [0.23, -1.0]
    # row 2, r = [2], V = [1.5]: A0 = 2 - 1.5 = 0.5, returns = [2.0]
    rewards, values, mask = _gae_case()
    advantages, returns = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.5, whiten=False)
    expected_advantages = torch.tensor([[0.1345, 0.21, 0.2], [0.03, -1.4, 0.0], [0.5, 0.0, 0.0]])
    expected_returns = torch.tensor([[0.6345, 0.81, 1.0], [0.23, -1.0, 0.0], [2.0, 0.0, 0.0]])
    torch.testing.assert_close(advantages, expected_advantages)
    torch.testing.assert_close(returns, expected_returns)


def test_gae_lambda_one_is_return_minus_value_and_lambda_zero_is_td() -> None:
    # lam = 1, gamma = 1: A_t = sum_{s >= t} r_s - V_t. Row 0: G = [1, 1, 1] -> A = [0.5, 0.4, 0.2]
    # lam = 0: A_t = delta_t = r_t + V_{t+1} - V_t. Row 0: [0.1, 0.2, 0.2]
    rewards, values, mask = _gae_case()
    monte_carlo, _ = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0, whiten=False)
    torch.testing.assert_close(monte_carlo[0], torch.tensor([0.5, 0.4, 0.2]))
    one_step, _ = gae_advantages(rewards, values, mask, gamma=1.0, lam=0.0, whiten=False)
    torch.testing.assert_close(one_step[0], torch.tensor([0.1, 0.2, 0.2]))


def _gae_plain_loop(
    rewards: list[float], values: list[float], gamma: float, lam: float
) -> tuple[list[float], list[float]]:
    """Textbook GAE on one episode given as Python lists (no padding, no tensors)."""
    advantages = [0.0] * len(rewards)
    next_advantage = 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(rewards) else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        next_advantage = delta + gamma * lam * next_advantage
        advantages[t] = next_advantage
    return advantages, [a + v for a, v in zip(advantages, values)]


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.99, 0.9), (0.7, 0.0), (0.5, 1.0)])
def test_gae_matches_a_plain_loop_on_random_episodes(gamma: float, lam: float) -> None:
    rng = random.Random(42)
    num_positions = 8
    lengths = [8, 5, 1, 0, 3, 7]
    rewards = torch.full((len(lengths), num_positions), NAN)
    values = torch.full((len(lengths), num_positions), 1e6)
    mask = torch.zeros(len(lengths), num_positions, dtype=torch.bool)
    expected_advantages = torch.zeros(len(lengths), num_positions)
    expected_returns = torch.zeros(len(lengths), num_positions)
    for row, length in enumerate(lengths):
        row_rewards = [rng.uniform(-1, 1) for _ in range(length)]
        row_values = [rng.uniform(-2, 2) for _ in range(length)]
        loop_advantages, loop_returns = _gae_plain_loop(row_rewards, row_values, gamma, lam)
        rewards[row, :length] = torch.tensor(row_rewards)
        values[row, :length] = torch.tensor(row_values)
        mask[row, :length] = True
        expected_advantages[row, :length] = torch.tensor(loop_advantages)
        expected_returns[row, :length] = torch.tensor(loop_returns)
    advantages, returns = gae_advantages(rewards, values, mask, gamma, lam, whiten=False)
    torch.testing.assert_close(advantages, expected_advantages)
    torch.testing.assert_close(returns, expected_returns)
    # Whitening changes the advantages only: mean 0 and unbiased variance 1 over the counted
    # tokens, the same numbers as whitening the raw ones, and the returns stay raw.
    whitened, whitened_returns = gae_advantages(rewards, values, mask, gamma, lam, whiten=True)
    torch.testing.assert_close(whitened, masked_whiten(expected_advantages, mask))
    assert whitened[mask].mean().item() == pytest.approx(0.0, abs=1e-6)
    assert whitened[mask].var(unbiased=True).item() == pytest.approx(1.0, rel=1e-5)
    assert whitened[~mask].abs().max().item() == 0.0
    torch.testing.assert_close(whitened_returns, expected_returns)


def test_gae_carries_no_gradient() -> None:
    values = torch.tensor([[0.5, 0.6]], requires_grad=True)
    advantages, returns = gae_advantages(torch.tensor([[0.0, 1.0]]), values, torch.ones(1, 2))
    assert not advantages.requires_grad and not returns.requires_grad


def test_gae_rejects_bad_masks_and_shapes() -> None:
    rewards, values, _ = _gae_case()
    with pytest.raises(ValueError, match="right-padded"):
        gae_advantages(rewards, values, torch.tensor([[0, 1, 1], [1, 1, 0], [1, 0, 0]]))
    with pytest.raises(ValueError, match=r"values has shape \(3, 2\)"):
        gae_advantages(rewards, values[:, :2], torch.ones(3, 3))
    with pytest.raises(ValueError, match="lam"):
        gae_advantages(rewards, values, torch.ones(3, 3), lam=1.5)


# -- REINFORCE++ --------------------------------------------------------------------------


def test_reinforce_pp_hand_computed() -> None:
    # scores [1, 0], kl_coef 0.5, kl row 0 = [0.2, 0.4], row 1 = [0.6], gamma = 1.
    # token rewards: row 0 = [-0.1, -0.2 + 1] = [-0.1, 0.8], row 1 = [-0.3]
    # returns G_t = score - 0.5 * sum_{s >= t} kl_s: row 0 = [0.7, 0.8], row 1 = [-0.3]
    # whiten over the 3 tokens: mean = 1.2 / 3 = 0.4, deviations 0.3, 0.4, -0.7,
    #   biased var = (0.09 + 0.16 + 0.49) / 3 = 0.74 / 3, A = deviation / sqrt(0.74 / 3)
    mask = torch.tensor([[1, 1], [1, 0]])
    kl = torch.tensor([[0.2, 0.4], [0.6, NAN]])
    rewards = sequence_reward_to_tokens(torch.tensor([1.0, 0.0]), mask, kl, kl_coef=0.5)
    torch.testing.assert_close(rewards, torch.tensor([[-0.1, 0.8], [-0.3, 0.0]]))
    torch.testing.assert_close(
        discounted_returns(rewards, mask), torch.tensor([[0.7, 0.8], [-0.3, 0.0]])
    )
    advantages = reinforce_pp_advantages(rewards, mask)
    std = math.sqrt(0.74 / 3)  # 0.496655
    expected = torch.tensor([[0.3 / std, 0.4 / std], [-0.7 / std, 0.0]])  # [0.604, 0.805], [-1.409]
    torch.testing.assert_close(advantages, expected)


def test_reinforce_pp_discount() -> None:
    # gamma = 0.5, one row r = [0, 0, 4]: G = [1, 2, 4], mean 7/3,
    # deviations [-4/3, -1/3, 5/3], biased var = (16 + 1 + 25) / 9 / 3 = 42 / 27
    rewards = torch.tensor([[0.0, 0.0, 4.0]])
    advantages = reinforce_pp_advantages(rewards, torch.ones(1, 3), gamma=0.5, epsilon=0.0)
    expected = torch.tensor([[-4 / 3, -1 / 3, 5 / 3]]) / math.sqrt(42 / 27)
    torch.testing.assert_close(advantages, expected)
