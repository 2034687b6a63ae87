"""A policy trained sharded (FSDP2, ``models.actor.sharded``) over Dask workers: the same
steps as one device, checkpoints and snapshots that resume on another number of ranks, and a
move of the update to other workers that training does not notice."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from flowrl.graph import PipelineGraph
from flowrl.planner.placement import Plan, plan_for
from flowrl.runtime.cluster import Cluster
from flowrl.spec.loader import pipeline_from_dict
from tests.integration.conftest import tiny_grpo
from tests.runtime.test_migration import ALL_ON_0, _train, _weights, started

pytestmark = pytest.mark.integration

TWO = {"train": ["cpu-0", "cpu-1"]}


def pipeline(tmp_path: Path, sharded: bool = True) -> PipelineGraph:
    spec = tiny_grpo(tmp_path / "out", steps=6).to_dict()
    spec["models"]["actor"]["sharded"] = sharded
    # several optimizer steps per rollout (shuffled mini-batches, old log-probs) and several
    # passes per step, so ranks gather and reduce-scatter more than once per step
    spec["nodes"]["train"].update({"ppo_epochs": 2, "mini_batch_size": 12, "micro_batch_tokens": 96})
    return pipeline_from_dict(spec)


def _close(want: list[dict[str, float]], got: list[dict[str, float]], first_step: int) -> None:
    assert len(got) == len(want)
    for step, (expected, measured) in enumerate(zip(want, got), start=first_step):
        for key, value in expected.items():
            # shards and reduce-scatters sum in another order; Adam amplifies the rounding
            assert measured[key] == pytest.approx(value, rel=1e-4, abs=1e-5), f"step {step}: {key}"


def _curve(cluster: Cluster, graph: PipelineGraph, plan: Plan, steps: range) -> list[dict[str, float]]:
    """A session on ``plan`` trained over ``steps``, then released (a worker's sharding group
    is its process's default group: the next session's group forms only after this one is
    left)."""
    session = started(cluster, graph, plan)
    curve = _train(session, graph, steps, {})
    session.release()
    return curve


def test_two_sharded_workers_train_the_policy_to_the_weights_of_one(tmp_path: Path) -> None:
    graph = pipeline(tmp_path)
    cluster = Cluster.start_local(2)
    try:
        alone = started(cluster, graph, plan_for(graph, ALL_ON_0))
        expected = _train(alone, graph, range(1, 4), {})
        expected_weights = _weights(alone, tmp_path / "alone")
        alone.release()

        sharded = started(cluster, graph, plan_for(graph, ALL_ON_0, node_shards=TWO))
        sharded.set_shares({"train": [3.0, 1.0]})  # uneven, as measured speeds set them
        curve = _train(sharded, graph, range(1, 4), {})
        weights = _weights(sharded, tmp_path / "sharded")
        addresses = [slot.address for slot in cluster.slots if slot.name in ("cpu-0", "cpu-1")]
        shapes = list(cluster.client.run(_trained_shapes, workers=addresses).values())
        sharded.release()
    finally:
        cluster.close()
    _close(expected, curve, 1)
    for name, tensor in expected_weights.items():
        # An element whose gradient is near zero moves by Adam's normalised step, up to lr
        # (5e-4) each, whose size follows the gradient's rounding: the shards' summation
        # order moved one element by 5.1e-5. A quarter of one step still fails a shard whose
        # gradient is lost: its rows fall behind by about lr per optimizer step.
        torch.testing.assert_close(weights[name], tensor, rtol=1e-4, atol=1.25e-4)
    # each rank trains its part of every parameter (rows, dim 0: 42 + 41 of the embedding's
    # 83) and keeps a whole copy beside it
    (first, whole), (second, whole_too) = shapes
    assert whole == whole_too
    for name, shape in whole.items():
        assert first[name][0] + second[name][0] == shape[0] and first[name][1:] == shape[1:], name
    assert (first["model.embed_tokens.weight"][0], second["model.embed_tokens.weight"][0]) == (42, 41)


def _trained_shapes(dask_worker: Any) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """(this rank's shard shapes, the whole copy's shapes) of the sharded actor on a worker."""
    from flowrl.roles.sharded import local_part
    from flowrl.runtime.host import RoleHost

    states = [host.models["actor"] for host in dask_worker.state.actors.values()
              if isinstance(host, RoleHost) and "actor" in host.models]
    [state] = [state for state in states if state.sharded is not None]
    local = {name: list(local_part(p).shape) for name, p in state.sharded.named_parameters()}
    return local, {name: list(p.shape) for name, p in state.module.named_parameters()}


@pytest.mark.parametrize("ranks_after", [1, 3])
def test_a_sharded_checkpoint_and_snapshot_resume_on_another_number_of_ranks(tmp_path: Path, ranks_after: int) -> None:
    # The trainer writes the whole weights and the optimizer state gathered from every rank,
    # so a run sharded over two workers resumes on one or three, on the same curve.
    graph = pipeline(tmp_path)
    after = {"train": ["cpu-0", "cpu-1", "cpu-2"][:ranks_after]} if ranks_after > 1 else None
    cluster = Cluster.start_local(3)
    try:
        expected = _curve(cluster, graph, plan_for(graph, ALL_ON_0, node_shards=TWO), range(1, 6))

        first = started(cluster, graph, plan_for(graph, ALL_ON_0, node_shards=TWO))
        _train(first, graph, range(1, 3), {})
        first.save_models(tmp_path / "checkpoint", with_state=True)
        _train(first, graph, range(3, 4), {})
        snapshot = first.snapshot()  # what fault recovery keeps, after step 3
        first.release()

        resumed = started(cluster, graph, plan_for(graph, ALL_ON_0, node_shards=after))
        resumed.load_checkpoint(tmp_path / "checkpoint")
        from_checkpoint = _train(resumed, graph, range(3, 5), {})
        resumed.release()

        restored = started(cluster, graph, plan_for(graph, ALL_ON_0, node_shards=after))
        restored.restore(snapshot)
        from_snapshot = _train(restored, graph, range(4, 6), {})
        restored.release()
    finally:
        cluster.close()
    _close(expected[2:4], from_checkpoint, 3)
    _close(expected[3:5], from_snapshot, 4)


def test_moving_a_sharded_update_to_other_workers_trains_on(tmp_path: Path) -> None:
    # The group changes (cpu-0 + cpu-1 -> cpu-0 + cpu-2): its ranks gather the whole optimizer
    # state as the old group goes, cpu-2 pulls it, and the new group shards it again.
    graph = pipeline(tmp_path)
    moved = {"train": ["cpu-0", "cpu-2"]}
    cluster = Cluster.start_local(3)
    try:
        expected = _curve(cluster, graph, plan_for(graph, ALL_ON_0, node_shards=TWO), range(1, 5))

        session = started(cluster, graph, plan_for(graph, ALL_ON_0, node_shards=TWO))
        curve = _train(session, graph, range(1, 3), {})
        session.apply_plan(plan_for(graph, ALL_ON_0, step=3, node_shards=moved))
        assert session.plan.slots_of("train") == ["cpu-0", "cpu-2"]
        curve += _train(session, graph, range(3, 5), {})
        session.release()
    finally:
        cluster.close()
    _close(expected, curve, 1)


def test_a_generator_on_another_worker_gets_the_sharded_update_s_weights(tmp_path: Path) -> None:
    # Rollout on cpu-2, the update sharded over cpu-0 and cpu-1: the trainer pushes its whole
    # copy, refreshed from the shards after each update; a stale copy would sample from old
    # weights and leave the one-device curve.
    graph = pipeline(tmp_path)
    elsewhere = {"rollout": "cpu-2", "reward": "cpu-2", "ref": "cpu-1", "adv": "cpu-0", "train": "cpu-0"}
    cluster = Cluster.start_local(3)
    try:
        expected = _curve(cluster, graph, plan_for(graph, ALL_ON_0), range(1, 5))

        session = started(cluster, graph, plan_for(graph, elsewhere, node_shards=TWO))
        assert session.plan.weight_peers("train", "actor")
        curve = _train(session, graph, range(1, 5), {})
        session.release()
    finally:
        cluster.close()
    _close(expected, curve, 1)
