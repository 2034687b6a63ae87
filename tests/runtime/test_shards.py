"""Data-parallel inference: a node split by rows over workers gives what one worker gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowrl.api.run import check_runnable
from flowrl.errors import FlowrlError
from flowrl.planner.placement import plan_for
from flowrl.roles.batch import Scores
from flowrl.roles.shards import join_shards, shard_rows
from flowrl.runtime.cluster import Cluster
from flowrl.runtime.session import Session
from flowrl.spec.loader import pipeline_from_dict
from tests.integration.conftest import tiny_grpo
from tests.runtime.test_migration import ALL_ON_0, _train


def test_rows_are_split_in_order_the_first_shards_one_longer() -> None:
    assert [shard_rows(10, i, 3) for i in range(3)] == [slice(0, 4), slice(4, 7), slice(7, 10)]
    assert [shard_rows(2, i, 2) for i in range(2)] == [slice(0, 1), slice(1, 2)]
    with pytest.raises(ValueError):
        shard_rows(4, 2, 2)


def test_joined_scores_and_their_metrics_are_the_whole_batch_ones() -> None:
    parts = [Scores(torch.tensor([0.5, 1.0]), 1), Scores(torch.tensor([0.0]), 0)]
    scores, metrics = join_shards("score", parts, rollout=None, with_failures=True)  # type: ignore[arg-type]
    assert scores.values.tolist() == [0.5, 1.0, 0.0] and scores.num_failed == 1
    assert metrics == {"critic/score/mean": 0.5, "critic/score/max": 1.0, "critic/score/min": 0.0, "reward/num_failed": 1.0}
    with pytest.raises(ValueError, match="cannot be split"):
        join_shards("update", [], rollout=None, with_failures=False)  # type: ignore[arg-type]


def test_a_split_node_puts_its_model_on_every_part(tmp_path: Path) -> None:
    pipeline = tiny_grpo(tmp_path, steps=1).build()
    plan = plan_for(pipeline, ALL_ON_0, node_shards={"ref": ["cpu-1", "cpu-0"]})
    assert plan.node_slots["ref"] == "cpu-1"
    assert plan.slots_of("ref") == ["cpu-1", "cpu-0"]
    assert plan.model_slots == {"actor": ["cpu-0"], "reference": ["cpu-1", "cpu-0"]}


def test_groups_of_several_devices_may_not_generate_yet(tmp_path: Path) -> None:
    spec = tiny_grpo(tmp_path, steps=1).to_dict()
    spec["devices"]["ref_group"]["count"] = 2
    check_runnable(pipeline_from_dict(spec))  # reference_logprob splits: runs
    spec["devices"]["actor_group"]["count"] = 2
    with pytest.raises(FlowrlError, match=r"devices.actor_group.count: .* runs rollout; set count: 1"):
        check_runnable(pipeline_from_dict(spec))


@pytest.mark.integration
def test_reference_and_reward_split_over_two_workers_train_like_one(tmp_path: Path) -> None:
    pipeline = tiny_grpo(tmp_path / "out", steps=3).build()
    cluster = Cluster.start_local(2)
    try:
        whole = Session(cluster, pipeline, plan_for(pipeline, ALL_ON_0), None)
        whole.load_models()
        expected = _train(whole, pipeline, range(1, 4), {})
        split_plan = plan_for(pipeline, ALL_ON_0, node_shards={"ref": ["cpu-1", "cpu-0"], "reward": ["cpu-0", "cpu-1"]})
        split = Session(cluster, pipeline, split_plan, None)
        split.load_models()
        curve = _train(split, pipeline, range(1, 4), {})
    finally:
        cluster.close()
    for step, (want, got) in enumerate(zip(expected, curve), start=1):
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), f"step {step}: {key}"
