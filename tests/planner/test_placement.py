"""The runtime's placement, read off the planner's plan: pure, no cluster."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flowrl.errors import PlacementError
from flowrl.planner.compiled import compile_plan
from flowrl.planner.placement import Plan, plan_from_compiled
from flowrl.spec.loader import load_pipeline, pipeline_from_dict

from tests.planner.conftest import cpu, gpu, inventory


PPO_TINY = Path(__file__).resolve().parents[2] / "pipelines" / "ppo_tiny.yaml"


def _data(**overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "name": "p",
        "models": {
            "actor": {"path": "builtin:tiny-llama", "device_group": "actor_group"},
            "reference": {"path": "builtin:tiny-llama", "device_group": "ref_group"},
        },
        "devices": {"actor_group": {"type": "cpu"}, "ref_group": {"type": "cpu"}},
        "nodes": {
            "rollout": {"role": "generate", "model": "actor", "inputs": ["prompts"]},
            "reward": {"role": "score", "fn": "digits", "inputs": ["rollout"]},
            "ref": {"role": "reference_logprob", "model": "reference", "inputs": ["rollout"]},
            "adv": {"role": "advantage", "inputs": ["reward"]},
            "train": {"role": "update", "model": "actor", "inputs": ["rollout", "adv", "ref"], "kl_coef": 0.1},
        },
        "data": {"source": "builtin:digits"},
    }
    data.update(overrides)
    return data


def _place(data: dict[str, Any], *devices: Any) -> Plan:
    pipeline = pipeline_from_dict(data)
    slots = [device.id for device in devices if device.kind == "cpu"]
    return plan_from_compiled(pipeline, compile_plan(pipeline, inventory(*devices)), slots)


def test_exclusive_groups_get_a_slot_each_and_modelless_nodes_run_next_to_their_input() -> None:
    data = _data(devices={"actor_group": {"type": "cpu", "exclusive": True}, "ref_group": {"type": "cpu"}})
    plan = _place(data, cpu(0), cpu(1))
    assert plan.group_slots == {"actor_group": ["cpu-0"], "ref_group": ["cpu-1"]}
    assert plan.node_slots == {"rollout": "cpu-0", "reward": "cpu-0", "ref": "cpu-1", "adv": "cpu-0", "train": "cpu-0"}
    assert plan.model_slots == {"actor": ["cpu-0"], "reference": ["cpu-1"]}
    assert plan.weight_peers("train", "actor") == []


def test_the_reference_shares_the_actor_s_slot_when_that_saves_the_transfers() -> None:
    # rollout -> ref -> train is a chain: a second slot lets no two of them run together, so
    # the planner puts the reference next to the actor (no copies of the rollout and the
    # log-probs between workers). The reward and advantage would overlap the reference on the
    # free slot, but that saves less than FEWER_CPU_SLOTS_WITHIN of the step: they stay too.
    pipeline = pipeline_from_dict(_data())
    compiled = compile_plan(pipeline, inventory(cpu(0), cpu(1)))
    assert compiled.shared == {"ref_group": "actor_group"}
    plan = plan_from_compiled(pipeline, compiled, ["cpu-0", "cpu-1"])
    assert plan.node_slots == {"rollout": "cpu-0", "reward": "cpu-0", "ref": "cpu-0", "adv": "cpu-0", "train": "cpu-0"}
    assert "ref_group on actor_group's devices" in next(n.reason for n in compiled.nodes if n.node == "ref")
    reward = next(n.reason for n in compiled.nodes if n.node == "reward")
    assert "next: cpu-1 (cpu slot) -" in reward and "on fewer CPU slots" in reward
    # the layout that came next: each group on a slot of its own; the actor on the
    # reference's slot is the chosen layout's mirror image, not another layout
    assert compiled.alternative is not None
    assert compiled.alternative.shared == {}
    assert compiled.alternative.iteration_s > compiled.iteration_s


def test_more_groups_than_slots_share_a_slot() -> None:
    plan = _place(_data(), cpu(0))
    assert plan.group_slots == {"actor_group": ["cpu-0"], "ref_group": ["cpu-0"]}


def test_a_pinned_group_gets_its_device() -> None:
    data = _data(devices={"actor_group": {"type": "cpu", "device_ids": [1]}, "ref_group": {"type": "cpu"}})
    plan = _place(data, cpu(0), cpu(1))
    assert plan.node_slots["rollout"] == "cpu-1" and plan.node_slots["train"] == "cpu-1"


def test_a_node_on_another_group_gets_a_copy_of_its_model_and_pushed_weights() -> None:
    data = _data()
    data["devices"]["gen_group"] = {"type": "cpu", "exclusive": True}
    data["nodes"]["rollout"]["device_group"] = "gen_group"
    plan = _place(data, cpu(0), cpu(1), cpu(2))
    assert plan.node_slots["rollout"] != plan.node_slots["train"]
    assert plan.model_slots["actor"] == [plan.node_slots["rollout"], plan.node_slots["train"]]
    assert plan.weight_peers("train", "actor") == [plan.node_slots["rollout"]]


def test_gpu_group_on_cpu_workers_is_refused_with_a_fix_and_a_critic_trains_over_several_devices() -> None:
    gpu_data = _data(devices={"actor_group": {"type": "gpu"}, "ref_group": {"type": "cpu"}})
    with pytest.raises(PlacementError, match="type: cpu"):
        _place(gpu_data, gpu(0, "A100-40GB", 40, 312, 1555), cpu(0), cpu(1))
    ppo = load_pipeline(PPO_TINY).spec.model_dump(
        mode="json", exclude_unset=True
    )
    ppo["devices"]["critic_group"]["count"] = 2
    plan = _place(ppo, cpu(0), cpu(1))
    # the critic's update shares the policy's optimizer loop, data parallelism included
    assert sorted(plan.slots_of("train_critic")) == ["cpu-0", "cpu-1"]


def test_a_group_of_two_devices_splits_generation_and_trains_data_parallel() -> None:
    wide = _data(devices={"actor_group": {"type": "cpu", "count": 2}, "ref_group": {"type": "cpu"}})
    plan = _place(wide, cpu(0), cpu(1))
    assert sorted(plan.slots_of("rollout")) == ["cpu-0", "cpu-1"]
    assert plan.slots_of("train") == plan.slots_of("rollout")
    assert sorted(plan.model_slots["actor"]) == ["cpu-0", "cpu-1"]
    # every copy of the actor trains: nobody waits for pushed weights
    assert plan.weight_peers("train", "actor") == []


def test_without_slots_moves_the_lost_slots_nodes_to_the_least_busy_survivor() -> None:
    from flowrl.planner.placement import plan_for, without_slots

    pipeline = pipeline_from_dict(_data())
    plan = plan_for(
        pipeline,
        {"rollout": "cpu-0", "reward": "cpu-0", "ref": "cpu-1", "adv": "cpu-0", "train": "cpu-0"},
        node_shards={"rollout": ["cpu-0", "cpu-2"]},
    )
    # cpu-0 is lost: rollout keeps its shard on cpu-2 (unsplit now); reward and adv go one by
    # one to the survivor with the fewest nodes (cpu-1 has ref, cpu-2 has rollout), and train
    # to cpu-2, where its model's rollout runs.
    shrunk = without_slots(pipeline, plan, {"cpu-0"}, ["cpu-1", "cpu-2"], step=7)
    assert shrunk.node_slots == {"rollout": "cpu-2", "reward": "cpu-1", "ref": "cpu-1", "adv": "cpu-2", "train": "cpu-2"}
    assert shrunk.node_shards == {} and shrunk.step == 7
    assert shrunk.model_slots == {"actor": ["cpu-2"], "reference": ["cpu-1"]}
    assert shrunk.reasons[0] == "reward -> cpu-1: cpu-0 was lost"
    with pytest.raises(PlacementError, match="no worker is left"):
        without_slots(pipeline, plan, {"cpu-0", "cpu-1", "cpu-2"}, [], step=7)


def test_without_slots_keeps_each_models_nodes_together() -> None:
    # PPO with everything on cpu-0: spreading the nodes one by one over two survivors put the
    # actor's rollout and update on different workers and the critic's value and update
    # crosswise, so each update pushed weights to the other's worker, and both pushes waited
    # for each other's worker
    from flowrl.planner.placement import plan_for, without_slots

    pipeline = load_pipeline(PPO_TINY)
    plan = plan_for(pipeline, {node: "cpu-0" for node in pipeline.spec.nodes})
    shrunk = without_slots(pipeline, plan, {"cpu-0"}, ["cpu-1", "cpu-2"], step=3)
    for model, slots in shrunk.model_slots.items():
        assert len(slots) == 1, (model, slots)
    for node in pipeline.spec.nodes:
        assert shrunk.weight_peers(node, pipeline.spec.nodes[node].model or "") == []
    assert set(shrunk.node_slots.values()) == {"cpu-1", "cpu-2"}


def test_a_step_s_change_reads_in_its_unit() -> None:
    from flowrl.planner.compiled import _signed_duration

    assert _signed_duration(0.01234) == "+12.34 ms"
    assert _signed_duration(-0.5) == "-500.00 ms"
    assert _signed_duration(42.04) == "+42.0 s"
    # a 7B reference on a CPU slot: 382,780.6 s
    assert _signed_duration(382780.6) == "+106.3 h"


def _crosswise(exclusive: bool) -> dict[str, Any]:
    """PPO whose actor trains in gb and generates in ga, and whose critic trains in ga and
    computes values in gb."""
    ppo = load_pipeline(PPO_TINY).spec.model_dump(
        mode="json", exclude_unset=True
    )
    ppo["devices"] = {"ga": {"type": "cpu", "exclusive": exclusive}, "gb": {"type": "cpu", "exclusive": exclusive}}
    for model in ppo["models"].values():
        model["device_group"] = "ga"
    ppo["nodes"]["values"]["device_group"] = "gb"
    ppo["nodes"]["train_actor"]["device_group"] = "gb"
    return ppo


def test_updates_that_push_weights_to_each_other_s_workers_are_refused_or_share_a_slot() -> None:
    # on two exclusive slots each update would wait for the other worker (busy with its own
    # update) to take its weights: every step would hang until the node timeout
    message = (r"'actor' trains on cpu-1 \(train_actor\) and sends its weights to its copy on cpu-0 \(rollout\); "
               r"'critic' trains on cpu-0 \(train_critic\) and sends its weights to its copy on cpu-1 \(values\): "
               r"each update would wait for a worker busy with the other update")
    with pytest.raises(PlacementError, match=message):
        _place(_crosswise(exclusive=True), cpu(0), cpu(1))
    # groups that may share a device: the planner puts them on one slot, and nothing is pushed
    plan = _place(_crosswise(exclusive=False), cpu(0), cpu(1))
    assert plan.weight_peers("train_actor", "actor") == [] and plan.weight_peers("train_critic", "critic") == []
    # a runtime plan made from node slots directly (a re-plan, a recovery) is refused too
    from flowrl.planner.placement import plan_for

    pipeline = pipeline_from_dict(_crosswise(exclusive=True))
    slots = {node: "cpu-0" for node in pipeline.spec.nodes} | {"values": "cpu-1", "train_actor": "cpu-1"}
    with pytest.raises(PlacementError, match="each update would wait"):
        plan_for(pipeline, slots)
    # one way only (the actor generates elsewhere, the critic stays whole) is no cycle
    plan = plan_for(pipeline, {node: "cpu-0" for node in pipeline.spec.nodes} | {"rollout": "cpu-1"})
    assert plan.weight_peers("train_actor", "actor") == ["cpu-1"]


def test_without_slots_sends_the_moved_nodes_where_no_weight_pushes_wait_for_each_other() -> None:
    # rollout split over cpu-1 and cpu-2, the critic's values on cpu-1 and its update on cpu-2,
    # the actor's update on cpu-0: no cycle. Losing cpu-0, the actor's home would be cpu-1 (its
    # rollout's first shard): the actor trained on cpu-1 pushing to cpu-2 and the critic
    # trained on cpu-2 pushing to cpu-1 would wait for each other. cpu-2 makes no cycle.
    from flowrl.planner.placement import plan_for, without_slots
    from flowrl.planner.pushes import push_cycle

    pipeline = load_pipeline(PPO_TINY)
    slots = {node: "cpu-1" for node in pipeline.spec.nodes} | {"train_critic": "cpu-2", "train_actor": "cpu-0"}
    plan = plan_for(pipeline, slots, node_shards={"rollout": ["cpu-1", "cpu-2"]})
    shrunk = without_slots(pipeline, plan, {"cpu-0"}, ["cpu-1", "cpu-2"], step=3)
    assert shrunk.node_slots["train_actor"] == "cpu-2"
    assert push_cycle(pipeline, {node: shrunk.slots_of(node) for node in shrunk.node_slots}) is None


def test_only_the_first_rank_of_a_data_parallel_update_pushes_weights() -> None:
    # the actor trains over cpu-0 and cpu-1 and generates on cpu-2; the critic trains on cpu-2
    # and computes values on cpu-1: rank 0 (cpu-0) pushes to cpu-2, cpu-2 pushes to cpu-1, and
    # cpu-1 is free once its part of the actor's update is done: no cycle
    from flowrl.planner.placement import plan_for

    pipeline = load_pipeline(PPO_TINY)
    slots = {node: "cpu-2" for node in pipeline.spec.nodes} | {"values": "cpu-1"}
    plan = plan_for(pipeline, slots, node_shards={"train_actor": ["cpu-0", "cpu-1"]})
    assert plan.weight_peers("train_actor", "actor") == ["cpu-2"]
    assert plan.weight_peers("train_critic", "critic") == ["cpu-1"]
