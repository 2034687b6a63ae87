"""A model held in bf16 trains through fp32 master weights: updates far below bf16's
resolution add up instead of rounding away, and the masters travel with the optimizer state
(checkpoints, migration, FSDP2 shards)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from flowrl.roles.master_weights import MasterWeightAdamW
from flowrl.roles.state import ModelState
from flowrl.roles.update import update_policy
from flowrl.spec.schema import UpdateNode
from tests.sharded_ranks import (
    ADVANTAGES,
    policy_state_bf16,
    rollout_of,
    run_sharded,
    train_policy_checking_masters,
)


def _steps(optimizer: torch.optim.Optimizer, weight: torch.nn.Parameter, steps: int) -> None:
    for _ in range(steps):
        weight.grad = torch.ones_like(weight)
        optimizer.step()


def test_small_steps_add_up_in_the_masters_and_reach_the_bf16_weight() -> None:
    # AdamW with a constant gradient moves a weight by lr each step (m/sqrt(v) = 1). bf16's
    # spacing just below 1.0 is 2^-8 = 0.0039: a step of 1e-3 from 1.0 rounds back to 1.0.
    plain = torch.nn.Parameter(torch.ones(1, dtype=torch.bfloat16))
    _steps(torch.optim.AdamW([plain], lr=1e-3, weight_decay=0.0), plain, 3)
    assert plain.item() == 1.0  # three updates, all lost

    kept = torch.nn.Parameter(torch.ones(1, dtype=torch.bfloat16))
    optimizer = MasterWeightAdamW([kept], lr=1e-3, weight_decay=0.0)
    _steps(optimizer, kept, 1)
    master = optimizer.state_dict()["state"][0]["master"]
    assert master.item() == pytest.approx(0.999, abs=1e-6) and kept.item() == 1.0  # nearer 1.0 than 0.99609
    _steps(optimizer, kept, 1)
    # 0.998 is 0.0019 from 0.99609375 and 0.002 from 1.0
    assert optimizer.state_dict()["state"][0]["master"].item() == pytest.approx(0.998, abs=1e-6)
    assert kept.item() == 0.99609375
    assert optimizer.state[optimizer.param_groups[0]["params"][0]]["exp_avg"].dtype == torch.float32
    assert kept.grad is not None and optimizer.param_groups[0]["params"][0].grad is None  # fp32 copy freed


def _bf16_state() -> ModelState:
    return policy_state_bf16()


def _update(state: ModelState, lr: float) -> None:
    node = UpdateNode(model="actor", inputs=["rollout", "adv"], lr=lr, max_grad_norm=1.0)
    update_policy(state, rollout_of(state), torch.tensor(ADVANTAGES), None, node, seed=0)


def test_a_bf16_policy_at_a_small_learning_rate_moves_every_weight_through_its_masters() -> None:
    state = _bf16_state()
    before = [p.detach().clone() for p in state.module.parameters()]
    for _ in range(3):
        _update(state, 1e-6)
    assert isinstance(state.optimizer, MasterWeightAdamW)
    masters = [entry["master"] for entry in state.optimizer.state_dict()["state"].values()]
    names = [name for name, _ in state.module.named_parameters()]
    for name, master, old in zip(names, masters, before):
        if name != "model.embed_tokens.weight":  # (only the rows of the rollout's tokens get a gradient)
            assert bool((master != old.float()).all()), name  # every entry moved in its master
    # ... while at lr 1e-6 only a few entries moved by a whole unit of bf16's last place
    rounded = sum(int((p.detach() != old).sum()) for p, old in zip(state.module.parameters(), before))
    assert rounded < 0.1 * sum(old.numel() for old in before)
    # the bf16 weights are the masters rounded
    for param, master in zip(state.module.parameters(), masters):
        assert torch.equal(param.detach(), master.to(torch.bfloat16))


def test_an_fp32_model_keeps_a_plain_adamw() -> None:
    from tests.sharded_ranks import policy_state

    state = policy_state()
    _update(state, 1e-3)
    assert type(state.optimizer) is torch.optim.AdamW
    assert "master" not in state.optimizer.state_dict()["state"][0]


def test_a_restored_copy_continues_from_the_masters_not_from_the_rounded_weights() -> None:
    whole = _bf16_state()
    for _ in range(2):
        _update(whole, 1e-5)
    # copied, as a checkpoint or a migration copies it (a state dict holds the live tensors)
    saved = copy.deepcopy({"weights": whole.weights(), "optimizer": whole.optimizer_state(),
                           "num_updates": whole.num_updates})
    moved = _bf16_state()
    moved.restore(saved)
    _update(whole, 1e-5)
    _update(moved, 1e-5)
    for (name, a), b in zip(whole.module.state_dict().items(), moved.module.state_dict().values()):
        assert torch.equal(a, b), name
    assert whole.optimizer is not None and moved.optimizer is not None
    for a, b in zip(whole.optimizer.state_dict()["state"].values(), moved.optimizer.state_dict()["state"].values()):
        assert torch.equal(a["master"], b["master"])
    # weights set from outside the optimizer (a copy that receives them) become its masters
    fresh = _bf16_state()
    moved.load_weights(fresh.weights())
    for param, master in zip(moved.module.parameters(), moved.optimizer.param_groups[0]["params"]):
        assert torch.equal(master, param.detach().float())


def test_a_sharded_bf16_update_shards_the_masters_and_gives_the_one_device_steps() -> None:
    node = UpdateNode(model="actor", inputs=["rollout", "adv", "ref"], lr=1e-3, mini_batch_size=3,
                      kl_coef=0.05, max_grad_norm=0.5)
    alone = _bf16_state()
    train_policy_checking_masters(node, 2, alone, None)
    ranks = run_sharded(policy_state_bf16, functools.partial(train_policy_checking_masters, node, 2), (0.6, 0.4))
    expected = alone.module.state_dict()
    for weights, _ in ranks:
        equal = total = 0
        for name, tensor in weights.items():
            # bf16 passes sum in another order over the shards (the loss differs by about 1 %):
            # an entry may move by up to half a step of lr 1e-3 otherwise (Adam's first steps
            # divide by sqrt(v), which amplifies that); most are the same bf16 number
            torch.testing.assert_close(tensor.float(), expected[name].float(), rtol=0, atol=5e-4, msg=name)
            equal += int((tensor == expected[name]).sum())
            total += tensor.numel()
        assert equal > 0.85 * total


def test_a_step_in_chunks_gives_the_step_in_one(monkeypatch: pytest.MonkeyPatch) -> None:
    import flowrl.roles.master_weights as master_weights

    whole, chunked = _bf16_state(), _bf16_state()
    _update(whole, 1e-3)
    monkeypatch.setattr(master_weights, "STEP_CHUNK_BYTES", 4096)  # a few parameters per chunk
    _update(chunked, 1e-3)
    for a, b in zip(whole.module.state_dict().values(), chunked.module.state_dict().values()):
        assert torch.equal(a, b)
    assert chunked.optimizer is not None
    assert all(master.grad is None for master in chunked.optimizer.param_groups[0]["params"])
    with pytest.raises(ValueError, match="no closure"):
        chunked.optimizer.step(lambda: 0.0)


def test_a_16_bit_state_loads_into_an_fp32_model_without_its_masters() -> None:
    from tests.sharded_ranks import policy_state

    held = _bf16_state()
    _update(held, 1e-3)
    saved = copy.deepcopy(held.optimizer_state())
    plain = policy_state()
    plain.restore({"optimizer": saved, "num_updates": 1})
    assert type(plain.optimizer) is torch.optim.AdamW
    assert all("master" not in entry for entry in plain.optimizer.state_dict()["state"].values())
    _update(plain, 1e-3)  # and it steps
