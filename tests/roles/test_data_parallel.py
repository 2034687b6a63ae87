"""Data-parallel update over a real gloo group: two ranks train exactly like one device.

The two ranks run in two threads of this process, each with its own copy of the model, joined
by a real ``ProcessGroupGloo`` (the same class the workers use), so the gradient sums go
through gloo's all-reduce.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from flowrl.roles.batch import Rollout
from flowrl.roles.data_parallel import DataParallel, weighted_rows
from flowrl.roles.state import ModelState
from flowrl.roles.update import update_critic, update_policy
from flowrl.runtime.collective import GlooGroup, free_port
from flowrl.spec.schema import UpdateNode
from tests.tiny_models import model_state, text_rollout, tiny_policy, tiny_scalar_model


def test_weighted_rows_give_each_rank_its_share_in_order() -> None:
    assert [weighted_rows(10, r, (1.0, 1.0, 1.0)) for r in range(3)] == [slice(0, 4), slice(4, 7), slice(7, 10)]
    # 0.7 / 0.3 of 10 rows: 7 and 3
    assert [weighted_rows(10, r, (0.7, 0.3)) for r in range(2)] == [slice(0, 7), slice(7, 10)]
    # 2 rows over shares 3:1 -> 1.5 and 0.5: the larger remainder rounds up first, then rank order
    assert [weighted_rows(2, r, (3.0, 1.0)) for r in range(2)] == [slice(0, 2), slice(2, 2)]


def _rollout(state: ModelState) -> Rollout:
    prompts = ["ab=", "ab=", "cd=", "cd=", "efg=", "efg="]
    completions = ["1", "xyz", "34", "z", "5678", "ab"]  # unequal lengths: token and sequence means differ
    return text_rollout(state.tokenizer, prompts, completions, group_size=2, max_new_tokens=4)


ADVANTAGES = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])


def _train_alone(node: UpdateNode, updates: int) -> tuple[ModelState, list[dict[str, float]]]:
    state = model_state("actor", tiny_policy(0), 0)
    rollout = _rollout(state)
    reference = torch.randn(6, rollout.completion_ids.shape[1], generator=torch.Generator().manual_seed(1)) * 0.1 - 2.0
    metrics = [update_policy(state, rollout, ADVANTAGES, reference, node, seed=0).metrics for _ in range(updates)]
    return state, metrics


def _ranks(make_state: Callable[[], ModelState], train: Callable[[ModelState, DataParallel], list[dict[str, float]]],
           shares: tuple[float, ...]) -> list[tuple[ModelState, list[dict[str, float]]]]:
    """Two gloo ranks (threads of this process), each training its state with ``train``."""
    port = free_port("127.0.0.1")
    results: list[Any] = [None, None]
    errors: list[BaseException] = []
    # built here, one after the other: torch's global RNG seeds the initial weights
    states = [make_state() for _ in range(2)]

    def rank(index: int) -> None:
        try:
            group = GlooGroup("127.0.0.1", port, index, 2, timeout_s=60)
            results[index] = (states[index], train(states[index], DataParallel(group, shares)))
        except BaseException as error:  # surfaced below, in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=rank, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    if errors:
        raise errors[0]
    return results


def _train_data_parallel(node: UpdateNode, updates: int, shares: tuple[float, ...]) -> list[tuple[ModelState, list[dict[str, float]]]]:
    def train(state: ModelState, dp: DataParallel) -> list[dict[str, float]]:
        rollout = _rollout(state)
        reference = torch.randn(6, rollout.completion_ids.shape[1], generator=torch.Generator().manual_seed(1)) * 0.1 - 2.0
        return [update_policy(state, rollout, ADVANTAGES, reference, node, seed=0, dp=dp).metrics for _ in range(updates)]

    return _ranks(lambda: model_state("actor", tiny_policy(0), 0), train, shares)


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("shares", [(1.0, 1.0), (0.7, 0.3)])
def test_two_ranks_train_to_the_same_weights_as_one_device(loss_agg: str, shares: tuple[float, ...]) -> None:
    # 2 epochs x mini-batches of 4 of 6 rows: shuffled, uneven mini-batches, old log-probs
    # gathered from both ranks, the KL term, gradient clipping
    node = UpdateNode(
        model="actor", inputs=["rollout", "adv", "ref"], lr=1e-2, ppo_epochs=2, mini_batch_size=4,
        kl_coef=0.05, loss_agg=loss_agg, max_grad_norm=0.5,
    )
    alone, alone_metrics = _train_alone(node, updates=2)
    ranks = _train_data_parallel(node, updates=2, shares=shares)
    expected = alone.module.state_dict()
    # The ranks hold bit-identical weights (same summed gradients, same steps). Against one
    # device they differ by summation order only; Adam's first steps divide by sqrt(v) and so
    # amplify that rounding: measured at most 7.3e-6 (weights of order 0.1) with shares 0.7/0.3.
    first = ranks[0][0].module.state_dict()
    for name, tensor in ranks[1][0].module.state_dict().items():
        assert torch.equal(tensor, first[name]), name
    for state, metrics in ranks:
        for name, tensor in state.module.state_dict().items():
            torch.testing.assert_close(tensor, expected[name], rtol=1e-4, atol=2e-5, msg=name)
        for got, want in zip(metrics, alone_metrics):
            for key in ("actor/loss", "actor/pg_loss", "actor/kl", "actor/grad_norm", "actor/clipfrac"):
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
        assert state.num_updates == 2


def test_a_critic_trains_over_two_ranks_like_on_one_device() -> None:
    # the critic shares the policy's optimizer loop: mini-batches, micro-batches, data parallelism
    node = UpdateNode(model="critic", inputs=["rollout", "adv"], lr=1e-2, ppo_epochs=2, mini_batch_size=4,
                      micro_batch_tokens=12, max_grad_norm=0.5, clip_range_value=0.2)

    def returns(rollout: Rollout) -> torch.Tensor:
        return rollout.completion_mask.float() * torch.linspace(-1.0, 1.0, rollout.completion_mask.shape[1])

    def train(state: ModelState, dp: DataParallel | None) -> list[dict[str, float]]:
        rollout = _rollout(state)
        return [update_critic(state, rollout, returns(rollout), None, node, seed=0, dp=dp).metrics for _ in range(2)]

    alone = model_state("critic", tiny_scalar_model(0), 0)
    alone_metrics = train(alone, None)
    ranks = _ranks(lambda: model_state("critic", tiny_scalar_model(0), 0), train, (0.7, 0.3))
    expected = alone.module.state_dict()
    for state, metrics in ranks:
        for name, tensor in state.module.state_dict().items():
            torch.testing.assert_close(tensor, expected[name], rtol=1e-4, atol=2e-5, msg=name)
        for got, want in zip(metrics, alone_metrics):
            for key in ("critic/vf_loss", "critic/grad_norm", "critic/vf_clipfrac", "critic/values_mean"):
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
            assert got["critic/num_optimizer_steps"] == 4.0 and got["critic/nonfinite_skipped"] == 0.0
