"""The critic update: clipped value regression moves values toward the returns."""

from __future__ import annotations

import itertools

import torch

from flowrl.roles.batch import Rollout
from flowrl.roles.update import update_critic
from flowrl.roles.state import ModelState
from flowrl.roles.value import run_value
from flowrl.spec.schema import UpdateNode
from tests.tiny_models import model_state, text_rollout, tiny_scalar_model


def _state(seed: int = 0) -> ModelState:
    return model_state("critic", tiny_scalar_model(seed), seed)


def _rollout(tokenizer: object) -> Rollout:
    return text_rollout(tokenizer, ["ab=", "ab=", "cd=", "cd="], ["123", "xy", "34", "z"], group_size=2, max_new_tokens=3)


def _masked_mean_abs_error(values: torch.Tensor, target: float, mask: torch.Tensor) -> float:
    return float(((values - target).abs() * mask).sum() / mask.sum())


def test_updates_on_constant_returns_move_values_toward_them_with_falling_loss() -> None:
    state = _state()
    rollout = _rollout(state.tokenizer)
    mask = rollout.completion_mask.float()
    returns = 0.5 * mask
    # Padding may hold anything (here NaN): it must reach neither loss nor gradient.
    returns = torch.where(mask.bool(), returns, torch.full_like(returns, float("nan")))
    node = UpdateNode(model="critic", inputs=["rollout", "adv"], lr=3e-3)
    start = run_value(state, rollout).value
    # A fresh head is zero: every value starts at exactly 0.
    assert torch.equal(start, torch.zeros_like(start))
    losses = []
    for _ in range(20):
        old_values = run_value(state, rollout).value
        output = update_critic(state, rollout, returns, old_values, node, seed=0)
        losses.append(output.metrics["critic/vf_loss"])
    end = run_value(state, rollout).value
    # Loss at step 0: 0.5 * (0 - 0.5)^2 = 0.125 on every token.
    assert abs(losses[0] - 0.125) < 1e-6
    # Adam's momentum overshoots a little after the values reach 0.5 (a damped swing), so
    # only the approach is strictly monotone.
    assert all(later < earlier for earlier, later in itertools.pairwise(losses[:6]))
    assert max(losses[-3:]) < 0.05 * losses[0]
    assert _masked_mean_abs_error(end, 0.5, mask) < 0.05
    assert torch.equal(end * (1 - mask), torch.zeros_like(end))  # padding stays 0
    for key in (
        "critic/vf_loss",
        "critic/vf_clipfrac",
        "critic/vpred_mean",
        "critic/grad_norm",
        "critic/num_optimizer_steps",
        "critic/lr",
        "critic/vf_explained_var",
    ):
        assert key in output.metrics
    assert state.num_updates == 20


def test_mini_batches_and_epochs_make_that_many_steps_and_the_clip_binds() -> None:
    state = _state()
    rollout = _rollout(state.tokenizer)
    mask = rollout.completion_mask.float()
    returns = 1.0 * mask
    node = UpdateNode(
        model="critic",
        lr=5e-2,
        betas=(0.9, 0.999),
        weight_decay=0.0,
        ppo_epochs=3,
        mini_batch_size=2,
        max_grad_norm=1.0,
        loss_agg="token_mean",
        clip_range_value=1e-3,
    )
    old_values = run_value(state, rollout).value
    output = update_critic(state, rollout, returns, old_values, node, seed=0)
    # 3 epochs x (4 sequences / 2 per mini-batch) = 6 optimizer steps.
    assert output.metrics["critic/num_optimizer_steps"] == 6.0
    # With a clip of 0.001 the values leave the band after the first steps, so some tokens
    # are clipped (the clipped error is the larger one) in later steps.
    assert output.metrics["critic/vf_clipfrac"] > 0.0


def test_without_old_values_they_are_computed_and_clipping_can_be_off() -> None:
    state = _state()
    rollout = _rollout(state.tokenizer)
    returns = rollout.completion_mask.float()
    node = UpdateNode(
        model="critic",
        lr=1e-2,
        betas=(0.9, 0.999),
        weight_decay=0.0,
        ppo_epochs=1,
        mini_batch_size=None,
        max_grad_norm=0.0,
        loss_agg="seq_mean",
        clip_range_value=None,
    )
    output = update_critic(state, rollout, returns, None, node, seed=0)
    # Fresh head: values 0, returns 1 -> 0.5 * 1^2 per token, 0.5 whatever the aggregation.
    assert abs(output.metrics["critic/vf_loss"] - 0.5) < 1e-6
    assert output.metrics["critic/vf_clipfrac"] == 0.0
    assert output.metrics["critic/grad_norm"] > 0.0


def test_the_old_values_pass_keeps_to_the_update_budget() -> None:
    state = _state()
    rollout = _rollout(state.tokenizer)
    tokens: list[int] = []
    handle = state.module.backbone.get_input_embeddings().register_forward_hook(
        lambda module, inputs, output: tokens.append(inputs[0].numel()))
    # 4 rows of 3 + 3 tokens (prompt + completion columns): a budget of 12 holds 2 rows per pass
    node = UpdateNode(model="critic", lr=1e-3, micro_batch_tokens=12)
    try:
        update_critic(state, rollout, rollout.completion_mask.float(), None, node, seed=0)
    finally:
        handle.remove()
    # the old values' no-grad passes, then the update's: none holds more than 12 tokens (the
    # whole rollout, 24, would not fit)
    assert len(tokens) >= 4 and max(tokens) <= 12, tokens
