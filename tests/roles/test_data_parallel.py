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
from flowrl.roles.data_parallel import BUCKET_BYTES, DataParallel, weighted_rows
from flowrl.roles.state import ModelState
from flowrl.roles.update import update_critic, update_policy
from flowrl.runtime.collective import DeviceGroup, free_port
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
           shares: tuple[float, ...], bucket_bytes: int = BUCKET_BYTES,
           ) -> list[tuple[ModelState, list[dict[str, float]], DataParallel]]:
    """One gloo rank per share (threads of this process), each training its state with ``train``."""
    world = len(shares)
    port = free_port("127.0.0.1")
    results: list[Any] = [None] * world
    errors: list[BaseException] = []
    # built here, one after the other: torch's global RNG seeds the initial weights
    states = [make_state() for _ in range(world)]

    def rank(index: int) -> None:
        try:
            group = DeviceGroup("127.0.0.1", port, index, world, timeout_s=60)
            dp = DataParallel(group, shares, bucket_bytes=bucket_bytes)
            results[index] = (states[index], train(states[index], dp), dp)
        except BaseException as error:  # surfaced below, in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=rank, args=(index,)) for index in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    if errors:
        raise errors[0]
    return results


def _train_data_parallel(node: UpdateNode, updates: int, shares: tuple[float, ...], bucket_bytes: int = BUCKET_BYTES,
                         ) -> list[tuple[ModelState, list[dict[str, float]], DataParallel]]:
    def train(state: ModelState, dp: DataParallel) -> list[dict[str, float]]:
        rollout = _rollout(state)
        reference = torch.randn(6, rollout.completion_ids.shape[1], generator=torch.Generator().manual_seed(1)) * 0.1 - 2.0
        return [update_policy(state, rollout, ADVANTAGES, reference, node, seed=0, dp=dp).metrics for _ in range(updates)]

    return _ranks(lambda: model_state("actor", tiny_policy(0), 0), train, shares, bucket_bytes)


@pytest.mark.parametrize("loss_agg, shares", [
    ("token_mean", (1.0, 1.0)), ("token_mean", (0.7, 0.3)), ("seq_mean", (1.0, 1.0)), ("seq_mean", (0.7, 0.3)),
    ("token_sum_norm", (0.7, 0.3)),
])
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
    for state, metrics, _ in ranks:
        for name, tensor in state.module.state_dict().items():
            torch.testing.assert_close(tensor, expected[name], rtol=1e-4, atol=2e-5, msg=name)
        for got, want in zip(metrics, alone_metrics):
            for key in ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/pg_clipfrac"):
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
    for state, metrics, _ in ranks:
        for name, tensor in state.module.state_dict().items():
            torch.testing.assert_close(tensor, expected[name], rtol=1e-4, atol=2e-5, msg=name)
        for got, want in zip(metrics, alone_metrics):
            for key in ("critic/vf_loss", "critic/grad_norm", "critic/vf_clipfrac", "critic/vpred_mean"):
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
            assert got["critic/num_optimizer_steps"] == 4.0 and got["critic/nonfinite_skipped"] == 0.0


@pytest.mark.parametrize("shares", [(1.0, 1.0), (0.5, 0.3, 0.2)], ids=["2 ranks", "3 ranks"])
def test_gradients_summed_in_buckets_during_the_backward_give_the_one_device_step(shares: tuple[float, ...]) -> None:
    # Buckets of 4 KB: the tiny policy's 19 parameter tensors (about 60 KB of gradients) go
    # in several all-reduces, most of them started before the backward has finished. Micro-
    # batches of 12 tokens: the sum starts only in the last pass's backward, after the
    # earlier passes have added into the gradients.
    node = UpdateNode(
        model="actor", inputs=["rollout", "adv", "ref"], lr=1e-2, ppo_epochs=2, mini_batch_size=4,
        kl_coef=0.05, max_grad_norm=0.5, micro_batch_tokens=12,
    )
    alone, alone_metrics = _train_alone(node, updates=2)
    ranks = _train_data_parallel(node, updates=2, shares=shares, bucket_bytes=4096)
    expected = alone.module.state_dict()
    first = ranks[0][0].module.state_dict()
    for state, metrics, dp in ranks:
        for name, tensor in state.module.state_dict().items():
            assert torch.equal(tensor, first[name]), name  # every rank takes the same steps
            torch.testing.assert_close(tensor, expected[name], rtol=1e-4, atol=2e-5, msg=name)
        for got, want in zip(metrics, alone_metrics):
            for key in ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
        buckets = dp._buckets_of(state.module).buckets
        assert len(buckets) > 3
        # 2 updates x 2 epochs x 2 mini-batches = 8 optimizer steps; a rank with rows in a
        # mini-batch starts all but the buckets of parameters it has no gradient for early
        assert dp.buckets_started_in_backward > 8


def test_buckets_cover_every_parameter_once_in_reverse_order() -> None:
    from flowrl.roles.data_parallel import _Buckets

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 300, 20, 20, 5)]
    buckets = _Buckets(params, bucket_bytes=100 * 4).buckets  # 100 floats per bucket
    assert buckets == [[4, 3, 2], [1], [0]]  # 45 floats; 300 alone (over the size); then 10
    # one flat tensor per bucket, so one dtype per bucket: each dtype fills buckets of its own
    params[3] = torch.nn.Parameter(torch.zeros(20, dtype=torch.float64))
    assert _Buckets(params, bucket_bytes=100 * 4).buckets == [[4, 2], [3], [1], [0]]
    alternating = [torch.nn.Parameter(torch.zeros(5, dtype=torch.float64 if n % 2 else torch.float32))
                   for n in range(6)]
    assert _Buckets(alternating, bucket_bytes=100 * 4).buckets == [[5, 3, 1], [4, 2, 0]]


def test_gradients_are_views_into_one_flat_tensor_per_bucket() -> None:
    # after a data-parallel step each parameter's gradient lies in its bucket's flat tensor:
    # autograd added into it and the all-reduce summed it in place, with no copy either way
    node = UpdateNode(model="actor", inputs=["rollout", "adv", "ref"], lr=1e-2, kl_coef=0.05)
    ranks = _train_data_parallel(node, updates=1, shares=(1.0, 1.0), bucket_bytes=4096)
    for state, _, dp in ranks:
        buckets = dp._buckets_of(state.module)
        storages = []
        for bucket in buckets.buckets:
            grads = [buckets.params[index].grad for index in bucket]
            assert all(grad is not None for grad in grads)
            pointers = {grad.untyped_storage().data_ptr() for grad in grads if grad is not None}
            assert len(pointers) == 1  # one flat tensor holds the whole bucket
            storages.append(pointers.pop())
        assert len(set(storages)) == len(buckets.buckets) > 3
        assert buckets.owner is None  # between steps the hooks do nothing


def test_a_module_s_buckets_serve_every_update_and_come_off_for_one_without_a_group() -> None:
    """A run makes a DataParallel per call of the update node: the buckets' flat tensors and
    hooks made by the first call serve the next ones. An update without the group takes the
    hooks off, and a later group update makes them again; the weights stay those of one
    device throughout."""
    node = UpdateNode(model="actor", inputs=["rollout", "adv", "ref"], lr=1e-2, kl_coef=0.05, micro_batch_tokens=12)
    alone, _ = _train_alone(node, updates=4)

    def hook_count(state: ModelState) -> list[int]:
        return [len(p._post_accumulate_grad_hooks or {}) for p in state.module.parameters()]

    def train(state: ModelState, dp: DataParallel) -> list[dict[str, float]]:
        rollout = _rollout(state)
        reference = torch.randn(6, rollout.completion_ids.shape[1], generator=torch.Generator().manual_seed(1)) * 0.1 - 2.0
        seen = []
        for update in range(4):
            call = None if update == 2 else DataParallel(dp.collective, dp.shares, bucket_bytes=dp.bucket_bytes)
            update_policy(state, rollout, ADVANTAGES, reference, node, seed=0, dp=call)
            if call is None:
                seen.append({"hooks": hook_count(state)})
                continue
            buckets = call._buckets_of(state.module)
            assert buckets.flats is not None
            seen.append({"buckets": buckets, "flats": [flat.data_ptr() for flat in buckets.flats],
                         "handles": list(buckets.hooks), "hooks": hook_count(state)})
        return seen

    for state, seen, _ in _ranks(lambda: model_state("actor", tiny_policy(0), 0), train, (1.0, 1.0)):
        first, second, without, again = seen
        assert second["buckets"] is first["buckets"] and second["flats"] == first["flats"]
        assert all(a is b for a, b in zip(second["handles"], first["handles"]))
        assert set(first["hooks"]) == set(second["hooks"]) == {1}  # one hook per parameter, not one per update
        assert set(without["hooks"]) == {0}
        assert again["buckets"] is not first["buckets"] and set(again["hooks"]) == {1}
        for name, tensor in state.module.state_dict().items():
            # four Adam steps carry the summation order's rounding further: 5e-5 at most here
            torch.testing.assert_close(tensor, alone.module.state_dict()[name], rtol=1e-4, atol=1e-4, msg=name)


def test_a_parameter_no_rank_used_keeps_no_gradient_and_weight_decay_leaves_it_alone() -> None:
    # AdamW skips a parameter whose gradient is None; a zero gradient would still decay it
    node = UpdateNode(model="actor", inputs=["rollout", "adv", "ref"], lr=1e-2, kl_coef=0.05, max_grad_norm=0.5,
                      weight_decay=0.1)

    def with_unused() -> ModelState:
        state = model_state("actor", tiny_policy(0), 0)
        state.module.register_parameter("unused", torch.nn.Parameter(torch.ones(3)))
        return state

    def train(state: ModelState, dp: DataParallel | None) -> list[dict[str, float]]:
        rollout = _rollout(state)
        reference = torch.randn(6, rollout.completion_ids.shape[1], generator=torch.Generator().manual_seed(1)) * 0.1 - 2.0
        return [update_policy(state, rollout, ADVANTAGES, reference, node, seed=0, dp=dp).metrics for _ in range(2)]

    alone = with_unused()
    train(alone, None)
    expected = alone.module.state_dict()
    assert torch.equal(expected["unused"], torch.ones(3)) and alone.module.get_parameter("unused").grad is None
    for state, _, _ in _ranks(with_unused, train, (0.7, 0.3)):
        assert state.module.get_parameter("unused").grad is None
        for name, tensor in state.module.state_dict().items():
            torch.testing.assert_close(tensor, expected[name], rtol=1e-4, atol=2e-5, msg=name)


def test_kept_buckets_let_the_model_go_and_an_error_lets_them_go() -> None:
    import gc
    import weakref

    from flowrl.roles.data_parallel import _KEPT

    group = DeviceGroup("127.0.0.1", free_port("127.0.0.1"), 0, 1, timeout_s=30)

    def step(module: torch.nn.Module, fail: bool = False) -> None:
        dp = DataParallel(group, (1.0,))
        with dp.attached(module):
            with dp.overlapping(module):
                module(torch.randn(2, 4)).sum().backward()
            if fail:
                raise RuntimeError("a pass failed")
            dp.sum_gradients(module, [1.0])

    module = torch.nn.Linear(4, 4)
    step(module)
    assert module in _KEPT
    with pytest.raises(RuntimeError, match="a pass failed"):
        step(module, fail=True)
    # all-reduces started before the error may still write into the old flat tensors
    assert module not in _KEPT and all(not p._post_accumulate_grad_hooks for p in module.parameters())
    step(module)
    weight = weakref.ref(module.weight)
    del module
    gc.collect()
    assert weight() is None  # the hooks do not keep the parameters (and their gradients) alive
