"""A sharded update (FSDP2 over a gloo group of 2 and 3 processes) gives the one-device steps:
the same weights after two updates, the same losses and gradient norms."""

from __future__ import annotations

import functools

import pytest
import torch

from flowrl.spec.schema import UpdateNode
from tests.sharded_ranks import (
    critic_state,
    logprobs_sharded_and_whole,
    policy_state,
    run_sharded,
    train_critic,
    train_policy,
)


def _close_to_one_device(ranks: list, alone: torch.nn.Module, alone_metrics: list, keys: tuple[str, ...]) -> None:
    expected = alone.state_dict()
    for weights, metrics in ranks:
        assert set(weights) == set(expected)
        for name, tensor in weights.items():
            # Summation order differs (shards, reduce-scatter); Adam's first steps divide by
            # sqrt(v) and amplify that rounding, as for the all-reduce path.
            torch.testing.assert_close(tensor, expected[name], rtol=1e-4, atol=2e-5, msg=name)
        for got, want in zip(metrics, alone_metrics):
            for key in keys:
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
            assert got[keys[0].split("/")[0] + "/nonfinite_skipped"] == 0.0


@pytest.mark.parametrize(
    ("shares", "mini_batch_size", "micro_batch_tokens"),
    [((1.0, 1.0), 4, None), ((0.5, 0.3, 0.2), 4, 12), ((1.0, 1.0, 1.0), 2, None)],
    ids=["2 ranks", "3 uneven ranks, uneven passes", "3 ranks, one without rows"],
)
def test_a_sharded_policy_update_gives_the_one_device_steps(
    shares: tuple[float, ...], mini_batch_size: int, micro_batch_tokens: int | None,
) -> None:
    # 2 epochs of shuffled mini-batches: old log-probs computed before the first step,
    # the KL term and gradient clipping; ranks with fewer passes (or no rows) run zero passes
    node = UpdateNode(model="actor", inputs=["rollout", "adv", "ref"], lr=1e-2, ppo_epochs=2,
                      mini_batch_size=mini_batch_size, micro_batch_tokens=micro_batch_tokens,
                      kl_coef=0.05, max_grad_norm=0.5)
    alone = policy_state()
    alone_metrics = train_policy(node, 2, alone, None)
    ranks = run_sharded(policy_state, functools.partial(train_policy, node, 2), shares)
    assert len(ranks) == len(shares)
    _close_to_one_device(ranks, alone.module, alone_metrics,
                         ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/pg_clipfrac"))


def test_a_sharded_critic_update_gives_the_one_device_steps() -> None:
    node = UpdateNode(model="critic", inputs=["rollout", "adv"], lr=1e-2, ppo_epochs=2, mini_batch_size=4,
                      micro_batch_tokens=12, max_grad_norm=0.5, clip_range_value=0.2)
    alone = critic_state()
    alone_metrics = train_critic(node, 2, alone, None)
    ranks = run_sharded(critic_state, functools.partial(train_critic, node, 2), (0.7, 0.3))
    _close_to_one_device(ranks, alone.module, alone_metrics,
                         ("critic/vf_loss", "critic/grad_norm", "critic/vf_clipfrac", "critic/vpred_mean"))


def test_a_sharded_models_log_probs_come_from_the_fused_head_in_its_own_forward() -> None:
    # the sharded forward gathers the parameters; the pass lays out its rows as a whole
    # copy's (here each shared prompt computed once) and the fused head stands in for the
    # model's output head (never called): on a CPU the whole copy's arithmetic, the same
    # numbers to the last bit, so a sharded policy equal to its reference has a KL gradient
    # of exactly 0
    ranks = run_sharded(policy_state, logprobs_sharded_and_whole, (1.0, 1.0))
    for _, [numbers] in ranks:
        assert numbers["same_layout"] == numbers["shared_prompts"] == 1.0
        assert numbers["head_calls"] == 0.0
        assert numbers["logprob_diff"] == numbers["no_grad_diff"] == numbers["entropy_diff"] == 0.0
        assert numbers["masked_zero"] == 0.0
        assert numbers["head_grad_norm"] > 0.0  # its gradient came back through the sharded backward
        assert numbers["grad_diff"] < 1e-6  # of the log-probs and entropies, as the whole copy's
        assert numbers["metric_entropy_grad"] == 0.0 and numbers["metric_entropy_diff"] == 0.0
