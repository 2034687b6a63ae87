"""Static placement: a pure function of the pipeline and the slots."""

from __future__ import annotations

import pytest

from flowrl.errors import PlacementError
from flowrl.planner.placement import plan_static
from flowrl.spec.loader import pipeline_from_dict


def _pipeline(**overrides):
    data = {
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
    for key, value in overrides.items():
        data[key] = value
    return pipeline_from_dict(data)


def test_one_group_per_slot_and_modelless_nodes_next_to_their_input() -> None:
    plan = plan_static(_pipeline(), ["cpu-0", "cpu-1"])
    assert plan.group_slots == {"actor_group": ["cpu-0"], "ref_group": ["cpu-1"]}
    assert plan.node_slots == {"rollout": "cpu-0", "reward": "cpu-0", "ref": "cpu-1", "adv": "cpu-0", "train": "cpu-0"}
    assert plan.model_slots == {"actor": ["cpu-0"], "reference": ["cpu-1"]}
    assert plan.weight_peers("train", "actor") == []


def test_more_groups_than_slots_share_round_robin() -> None:
    plan = plan_static(_pipeline(), ["cpu-0"])
    assert plan.group_slots == {"actor_group": ["cpu-0"], "ref_group": ["cpu-0"]}
    assert any("shared" in reason for reason in plan.reasons)


def test_a_matched_assignment_decides_the_slot() -> None:
    plan = plan_static(_pipeline(), ["cpu-0", "cpu-1"], assignment={"actor_group": ["cpu-1"], "ref_group": ["cpu-0"]})
    assert plan.node_slots["rollout"] == "cpu-1" and plan.node_slots["ref"] == "cpu-0"


def test_a_node_on_another_group_gets_a_copy_of_its_model_and_pushed_weights() -> None:
    pipeline = _pipeline()
    data = pipeline.to_dict()
    data["devices"]["gen_group"] = {"type": "cpu"}
    data["nodes"]["rollout"]["device_group"] = "gen_group"
    plan = plan_static(pipeline_from_dict(data), ["cpu-0", "cpu-1", "cpu-2"])
    assert plan.node_slots["rollout"] == "cpu-2"
    assert plan.model_slots["actor"] == ["cpu-2", "cpu-0"]
    assert plan.weight_peers("train", "actor") == ["cpu-2"]


def test_gpu_group_on_cpu_workers_and_multi_device_groups_are_refused_with_a_fix() -> None:
    gpu = _pipeline(devices={"actor_group": {"type": "gpu"}, "ref_group": {"type": "cpu"}})
    with pytest.raises(PlacementError, match="type: cpu"):
        plan_static(gpu, ["cpu-0", "cpu-1"])
    wide = _pipeline(devices={"actor_group": {"type": "cpu", "count": 2}, "ref_group": {"type": "cpu"}})
    with pytest.raises(PlacementError, match="count: 1"):
        plan_static(wide, ["cpu-0", "cpu-1"])
