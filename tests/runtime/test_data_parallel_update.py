"""A policy trained data-parallel over two Dask workers (gloo) equals one trained on one."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from flowrl.graph import PipelineGraph
from flowrl.planner.placement import plan_for
from flowrl.runtime.cluster import Cluster
from flowrl.spec.loader import pipeline_from_dict
from tests.integration.conftest import tiny_grpo
from tests.runtime.test_migration import ALL_ON_0, _train, _weights, started

pytestmark = pytest.mark.integration


def pipeline(tmp_path: Path, lora: bool = False) -> PipelineGraph:
    spec = tiny_grpo(tmp_path / "out", steps=4).to_dict()
    # several optimizer steps per rollout: shuffled mini-batches, old log-probs
    spec["nodes"]["train"].update({"ppo_epochs": 2, "mini_batch_size": 12})
    if lora:  # only the adapters' gradients are summed; the ranks start from equal adapters
        spec["models"]["actor"]["lora"] = {"rank": 4}
        spec["nodes"]["train"]["lr"] = 5e-3
    return pipeline_from_dict(spec)


@pytest.mark.parametrize(("shares", "lora"), [(None, False), ([3.0, 1.0], False), (None, True)],
                         ids=["equal", "uneven", "adapters"])
def test_two_workers_train_the_policy_to_the_weights_of_one(tmp_path: Path, shares: list[float] | None,
                                                           lora: bool) -> None:
    graph = pipeline(tmp_path, lora)
    cluster = Cluster.start_local(2)
    try:
        alone = started(cluster, graph, plan_for(graph, ALL_ON_0))
        expected = _train(alone, graph, range(1, 5), {})
        expected_weights = _weights(alone, tmp_path / "alone")

        plan = plan_for(graph, ALL_ON_0, node_shards={"train": ["cpu-0", "cpu-1"]})
        assert plan.model_slots["actor"] == ["cpu-0", "cpu-1"]
        parallel = started(cluster, graph, plan)
        if shares is not None:  # as the run sets them from measured speed, between steps
            parallel.set_shares({"train": shares})
        curve = _train(parallel, graph, range(1, 5), {})
        weights = _weights(parallel, tmp_path / "parallel")
    finally:
        cluster.close()
    for step, (want, got) in enumerate(zip(expected, curve), start=1):
        for key, value in want.items():
            # Adam amplifies summation-order rounding a little, step after step
            assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-5), f"step {step}: {key}"
    for name, tensor in expected_weights.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-4, atol=5e-5)


def test_the_group_is_formed_again_without_a_killed_member_and_training_goes_on(tmp_path: Path) -> None:
    graph = pipeline(tmp_path)
    cluster = Cluster.start_local(3)
    try:
        session = started(cluster, graph, plan_for(graph, ALL_ON_0, node_shards={"train": ["cpu-0", "cpu-1"]}))
        before = _train(session, graph, range(1, 3), {})
        pids = cluster.client.run(os.getpid)
        victim = next(slot for slot in cluster.slots if slot.name == "cpu-1")
        os.kill(pids[victim.address], signal.SIGKILL)
        # the survivor's all-reduce fails instead of waiting for ever
        with pytest.raises(Exception):
            _train(session, graph, range(3, 4), {})
        # the same session: cpu-2 joins cpu-0 in a new group (new port); cpu-2 pulls weights and
        # optimizer state from cpu-0, which kept training state through the failure
        survivors = {**ALL_ON_0, "ref": "cpu-2"}  # the reference lived on cpu-1 too
        session.apply_plan(plan_for(graph, survivors, node_shards={"train": ["cpu-0", "cpu-2"]}))
        after = _train(session, graph, range(4, 7), {})
    finally:
        cluster.close()
    assert session.plan.slots_of("train") == ["cpu-0", "cpu-2"]
    assert len(after) == 3
    for metrics in after:
        assert all(torch.isfinite(torch.tensor(value)) for value in metrics.values())
    # the model kept learning from where it was: not a fresh start
    assert after[0]["critic/score/mean"] != before[0]["critic/score/mean"]


@pytest.mark.parametrize("ranks_after", [1, 3])
def test_a_checkpoint_of_two_ranks_resumes_on_another_number_of_ranks_on_the_same_curve(
    tmp_path: Path, ranks_after: int
) -> None:
    # Every rank holds the whole model and the training copy writes it whole, so a checkpoint
    # taken over two ranks loads onto one rank or three, and the run goes on as if nothing
    # had happened: same rollouts (generation stays on cpu-0 with its saved RNG), same
    # mini-batch shuffle (a function of the update count), same optimizer state.
    graph = pipeline(tmp_path)
    two_ranks = {"train": ["cpu-0", "cpu-1"]}
    after = {"train": ["cpu-0", "cpu-1", "cpu-2"][:ranks_after]} if ranks_after > 1 else None
    cluster = Cluster.start_local(3)
    try:
        expected = _train(started(cluster, graph, plan_for(graph, ALL_ON_0, node_shards=two_ranks)), graph, range(1, 5), {})
        first = started(cluster, graph, plan_for(graph, ALL_ON_0, node_shards=two_ranks))
        _train(first, graph, range(1, 3), {})
        first.save_models(tmp_path / "checkpoint", with_state=True)
        resumed = started(cluster, graph, plan_for(graph, ALL_ON_0, node_shards=after))
        assert resumed.plan.slots_of("train") == (after or {"train": ["cpu-0"]})["train"]
        resumed.load_checkpoint(tmp_path / "checkpoint")
        curve = _train(resumed, graph, range(3, 5), {})
    finally:
        cluster.close()
    for step, (want, got) in enumerate(zip(expected[2:], curve), start=3):
        for key, value in want.items():
            # a different number of ranks sums the gradient in another order
            assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-5), f"step {step}: {key}"
