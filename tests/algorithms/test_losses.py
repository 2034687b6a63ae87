"""Clipped policy and value losses, masking and aggregation on hand-computed tensors.

TRL 1.16 ships no PPO trainer, so there is no TRL value loss to compare with; the clipped
value loss below is checked by hand only.
"""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.algorithms.losses import aggregate, masked_mean, policy_loss, value_loss

NAN = float("nan")


def test_masked_mean_ignores_padding_even_nan() -> None:
    x = torch.tensor([[1.0, 2.0, NAN], [4.0, NAN, NAN]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # all: (1 + 2 + 4) / 3 = 7/3; per row: [1.5, 4]
    assert masked_mean(x, mask).item() == pytest.approx(7 / 3)
    torch.testing.assert_close(masked_mean(x, mask, dim=-1), torch.tensor([1.5, 4.0]))
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0


def _clip_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two sequences of 3 positions, clip_eps = 0.2.

    seq 0, A = +1: token a ratio 1.5, token b ratio 0.9, one padded position.
    seq 1, A = -1: token c ratio 1.5, two padded positions.
    Padded positions hold NaN to prove they never reach the loss or the gradient.
    """
    old = torch.full((2, 3), -1.0)
    log_ratio = torch.tensor([[math.log(1.5), math.log(0.9), NAN], [math.log(1.5), NAN, NAN]])
    logprobs = (old + log_ratio).requires_grad_(True)
    advantages = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    return logprobs, old, advantages, mask


def test_clipping_active_on_one_token_and_not_the_others() -> None:
    # per token -min(r*A, clip(r, 0.8, 1.2)*A):
    #   a: r=1.5, A=+1: min(1.5, 1.2) = 1.2   -> -1.2  (clipped: no gradient)
    #   b: r=0.9, A=+1: min(0.9, 0.9) = 0.9   -> -0.9  (inside the trust region)
    #   c: r=1.5, A=-1: min(-1.5, -1.2) = -1.5 -> +1.5 (pessimistic side: not clipped)
    # token_mean = (-1.2 - 0.9 + 1.5) / 3 = -0.2
    logprobs, old, advantages, mask = _clip_case()
    loss, stats = policy_loss(logprobs, old, advantages, mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(-0.2, abs=1e-6)
    assert float(stats["pg_loss"]) == pytest.approx(-0.2, abs=1e-6)
    assert float(stats["pg_clipfrac"]) == pytest.approx(1 / 3)  # only token a
    assert float(stats["ratio_mean"]) == pytest.approx((1.5 + 0.9 + 1.5) / 3)  # 1.3
    # ppo_kl: token mean of old - new = -(ln 1.5 + ln 0.9 + ln 1.5) / 3
    assert float(stats["ppo_kl"]) == pytest.approx(-(2 * math.log(1.5) + math.log(0.9)) / 3)
    loss.backward()
    # d(-r*A)/dlogp = -r*A (since dr/dlogp = r), divided by the 3 counted tokens:
    #   a: clipped -> 0;  b: -0.9 / 3 = -0.3;  c: +1.5 / 3 = 0.5;  padding: exactly 0, not NaN
    assert logprobs.grad is not None
    expected_grad = torch.tensor([[0.0, -0.3, 0.0], [0.5, 0.0, 0.0]])
    torch.testing.assert_close(logprobs.grad, expected_grad)


def test_seq_mean_differs_from_token_mean() -> None:
    # seq_mean: seq 0 mean = (-1.2 - 0.9) / 2 = -1.05, seq 1 mean = 1.5
    #   -> (-1.05 + 1.5) / 2 = 0.225   (token_mean gave -0.2: seq 1's single token weighs more)
    logprobs, old, advantages, mask = _clip_case()
    loss, _ = policy_loss(logprobs, old, advantages, mask, clip_eps=0.2, loss_agg="seq_mean")
    assert loss.item() == pytest.approx(0.225, abs=1e-6)
    loss.backward()
    # seq 0 tokens weigh 1/2 * 1/2, seq 1's token 1/2: b: -0.9/4 = -0.225, c: 1.5/2 = 0.75
    assert logprobs.grad is not None
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -0.225, 0.0], [0.75, 0.0, 0.0]]))


def test_seq_mean_leaves_out_sequences_without_tokens() -> None:
    # A third, fully padded sequence must not pull the mean toward 0 (0.225, not 0.15).
    logprobs, old, advantages, mask = _clip_case()
    logprobs = torch.cat([logprobs.detach(), torch.full((1, 3), NAN)])
    old = torch.cat([old, torch.full((1, 3), NAN)])
    advantages = torch.cat([advantages, torch.tensor([NAN])])
    mask = torch.cat([mask, torch.zeros(1, 3, dtype=mask.dtype)])
    loss, _ = policy_loss(logprobs, old, advantages, mask, clip_eps=0.2, loss_agg="seq_mean")
    assert loss.item() == pytest.approx(0.225, abs=1e-6)


def test_padding_changes_nothing() -> None:
    # Extra padded positions with arbitrary values: same loss, same stats.
    logprobs, old, advantages, mask = _clip_case()
    base_loss, base_stats = policy_loss(logprobs, old, advantages, mask, clip_eps=0.2)
    junk = torch.tensor([[5.0, -7.0], [1e9, -1e9]])
    wider_loss, wider_stats = policy_loss(
        torch.cat([logprobs.detach(), junk], dim=1),
        torch.cat([old, -junk], dim=1),
        advantages,
        torch.cat([mask, torch.zeros(2, 2, dtype=mask.dtype)], dim=1),
        clip_eps=0.2,
    )
    assert wider_loss.item() == pytest.approx(base_loss.item())
    assert {key: float(value) for key, value in wider_stats.items()} == pytest.approx(
        {key: float(value) for key, value in base_stats.items()})


def test_per_token_advantages_equal_broadcast_sequence_advantages() -> None:
    logprobs, old, advantages, mask = _clip_case()
    per_token = advantages.unsqueeze(-1).expand(2, 3).clone()
    per_token[0, 2] = NAN  # padding
    loss_seq, _ = policy_loss(logprobs, old, advantages, mask, clip_eps=0.2)
    loss_tok, _ = policy_loss(logprobs, old, per_token, mask, clip_eps=0.2)
    assert loss_tok.item() == pytest.approx(loss_seq.item())


def test_on_policy_loss_is_reinforce() -> None:
    # ratio = 1 everywhere: loss = -mean(A) over tokens, gradient = -A / num_tokens.
    # A = [2, -1], 2 + 1 tokens: loss = -(2 + 2 - 1) / 3 = -1; grads -2/3, -2/3, +1/3
    logprobs = torch.tensor([[-0.5, -1.5], [-2.0, -3.0]], requires_grad=True)
    mask = torch.tensor([[True, True], [True, False]])
    loss, stats = policy_loss(logprobs, logprobs.detach(), torch.tensor([2.0, -1.0]), mask, 0.2)
    assert loss.item() == pytest.approx(-1.0)
    assert float(stats["pg_clipfrac"]) == 0.0 and float(stats["ratio_mean"]) == pytest.approx(1.0)
    loss.backward()
    assert logprobs.grad is not None
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-2 / 3, -2 / 3], [1 / 3, 0.0]]))


def test_all_padding_gives_zero_loss_with_a_graph() -> None:
    logprobs = torch.zeros(2, 2, requires_grad=True)
    for loss_agg in ("token_mean", "seq_mean"):
        loss, stats = policy_loss(
            logprobs, torch.zeros(2, 2), torch.ones(2), torch.zeros(2, 2), 0.2, loss_agg
        )
        assert loss.item() == 0.0 and float(stats["pg_clipfrac"]) == 0.0
        loss.backward()  # no "does not require grad" error, no NaN
    assert logprobs.grad is not None and not logprobs.grad.isnan().any()


def test_errors() -> None:
    with pytest.raises(ValueError, match="same"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 2), 0.2)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3), 0.2)
    with pytest.raises(ValueError, match="unknown loss_agg 'sum'"):
        aggregate(torch.zeros(2, 3), torch.ones(2, 3), "sum")  # type: ignore[arg-type]


def _value_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows [a, b, pad] and [c, pad, pad]; padding holds NaN. clip_range_value = 0.2.

    a: v = 1.0, v_old = 0.5, R = 1.2 (moved 0.5 toward R, past the 0.2 allowed)
    b: v = 0.6, v_old = 0.5, R = 0.0 (moved 0.1: inside the range)
    c: v = 0.0, v_old = 0.5, R = 1.0 (moved 0.5 away from R)
    """
    values = torch.tensor([[1.0, 0.6, NAN], [0.0, NAN, NAN]], requires_grad=True)
    old_values = torch.tensor([[0.5, 0.5, NAN], [0.5, NAN, NAN]])
    returns = torch.tensor([[1.2, 0.0, NAN], [1.0, NAN, NAN]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    return values, old_values, returns, mask


def test_token_sum_norm_divides_by_a_constant_not_by_the_tokens() -> None:
    # per token -1.2, -0.9 | +1.5 (as above); sum -1.2 - 0.9 + 1.5 = -0.6, over 2 rows x 4 tokens
    logprobs, old, advantages, mask = _clip_case()
    loss, _ = policy_loss(logprobs, old, advantages, mask, clip_eps=0.2, loss_agg="token_sum_norm", norm_tokens=4)
    assert loss.item() == pytest.approx(-0.6 / 8, abs=1e-7)
    loss.backward()
    assert logprobs.grad is not None
    # each token's gradient is its -r*A over the constant 8: b: -0.9 / 8, c: +1.5 / 8
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -0.9 / 8, 0.0], [1.5 / 8, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="needs norm_tokens"):
        aggregate(torch.zeros(2, 3), mask, "token_sum_norm")


def test_clip_higher_widens_only_the_upper_side() -> None:
    # clip_eps 0.2, clip_eps_high 0.6: the ratio is clipped to [0.8, 1.6]
    #   a: r=1.5, A=+1: inside the wider upper range now: -1.5, with gradient
    #   b: r=0.9, A=+1: -0.9;  c: r=1.5, A=-1: +1.5 (not clipped, as before)
    # token_mean = (-1.5 - 0.9 + 1.5) / 3 = -0.3
    logprobs, old, advantages, mask = _clip_case()
    loss, stats = policy_loss(logprobs, old, advantages, mask, clip_eps=0.2, clip_eps_high=0.6)
    assert loss.item() == pytest.approx(-0.3, abs=1e-6)
    assert float(stats["pg_clipfrac"]) == 0.0
    loss.backward()
    assert logprobs.grad is not None
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.5, -0.3, 0.0], [0.5, 0.0, 0.0]]))
    # the lower side still clips at 1 - clip_eps: r=0.5 with A=-1
    ratio_half = (old + math.log(0.5)).requires_grad_(True)
    low, low_stats = policy_loss(ratio_half, old, torch.tensor([-1.0, -1.0]), torch.ones(2, 3), clip_eps=0.2,
                                 clip_eps_high=0.6)
    # A=-1, r=0.5: -min(-0.5, -0.8) = 0.8 on every token (clipped at 1 - 0.2)
    assert low.item() == pytest.approx(0.8)
    assert float(low_stats["pg_clipfrac"]) == 1.0


def test_token_weights_scale_each_tokens_term() -> None:
    # the clip case with clip_eps_high 0.6 (terms -1.5, -0.9, +1.5), weighted 2, 0.5, 1:
    # token_mean = (-3.0 - 0.45 + 1.5) / 3 = -0.65; each token's gradient scales with its weight
    logprobs, old, advantages, mask = _clip_case()
    weights = torch.tensor([[2.0, 0.5, 7.0], [1.0, 7.0, 7.0]])  # 7s sit on padding or on no term
    loss, _ = policy_loss(logprobs, old, advantages, mask, clip_eps=0.2, clip_eps_high=0.6, token_weights=weights)
    assert loss.item() == pytest.approx(-0.65, abs=1e-6)
    loss.backward()
    assert logprobs.grad is not None
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.0, -0.15, 0.0], [0.5, 0.0, 0.0]]))


def test_clipped_value_loss_hand_computed() -> None:
    # per token 0.5 * max((v - R)^2, (clip(v, v_old - 0.2, v_old + 0.2) - R)^2):
    #   a: (1.0 - 1.2)^2 = 0.04 vs (0.7 - 1.2)^2 = 0.25 -> clipped is larger: 0.125, no gradient
    #   b: (0.6 - 0.0)^2 = 0.36 vs (0.6 - 0.0)^2 = 0.36 -> same (inside the range): 0.18
    #   c: (0.0 - 1.0)^2 = 1.0  vs (0.3 - 1.0)^2 = 0.49 -> unclipped is larger:     0.5
    # token_mean = (0.125 + 0.18 + 0.5) / 3 = 0.268333; vf_clipfrac = 1/3 (token a)
    values, old_values, returns, mask = _value_case()
    loss, stats = value_loss(values, old_values, returns, mask, clip_range_value=0.2)
    assert loss.item() == pytest.approx(0.805 / 3)
    assert float(stats["vf_loss"]) == pytest.approx(0.805 / 3)
    assert float(stats["vf_clipfrac"]) == pytest.approx(1 / 3)
    assert float(stats["vpred_mean"]) == pytest.approx((1.0 + 0.6 + 0.0) / 3)
    loss.backward()
    # d/dv 0.5 * (v - R)^2 = v - R, over 3 tokens: a: 0 (clipped), b: 0.6 / 3, c: -1 / 3
    assert values.grad is not None
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.2, 0.0], [-1 / 3, 0.0, 0.0]]))


def test_value_loss_without_clipping_and_with_seq_mean() -> None:
    # No clipping: a: 0.5 * 0.04 = 0.02, b: 0.18, c: 0.5 -> token_mean = 0.7 / 3
    values, old_values, returns, mask = _value_case()
    loss, stats = value_loss(values, old_values, returns, mask, clip_range_value=None)
    assert loss.item() == pytest.approx(0.7 / 3)
    assert float(stats["vf_clipfrac"]) == 0.0
    # Clipped, seq_mean: row 0 = (0.125 + 0.18) / 2 = 0.1525, row 1 = 0.5 -> 0.32625
    loss, _ = value_loss(values, old_values, returns, mask, 0.2, loss_agg="seq_mean")
    assert loss.item() == pytest.approx(0.32625)


def test_value_loss_wide_clip_range_is_plain_mse() -> None:
    # Every move is within 10 of v_old: the clipped value is v itself, loss = 0.5 * MSE.
    values, old_values, returns, mask = _value_case()
    loss, stats = value_loss(values, old_values, returns, mask, clip_range_value=10.0)
    assert loss.item() == pytest.approx(0.7 / 3)
    assert float(stats["vf_clipfrac"]) == 0.0


def test_value_loss_errors() -> None:
    values, old_values, returns, mask = _value_case()
    with pytest.raises(ValueError, match="clip_range_value must be > 0"):
        value_loss(values, old_values, returns, mask, clip_range_value=0.0)
    with pytest.raises(ValueError, match="same"):
        value_loss(values, old_values, returns[:, :2], mask, clip_range_value=0.2)
