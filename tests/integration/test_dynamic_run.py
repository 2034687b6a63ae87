"""A run under the dynamic policy: measured, smoothed, reported; slots pinned to cores."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from flowrl.api.run import run
from flowrl.errors import ClusterError
from flowrl.planner.placement import plan_for
from flowrl.runtime.cluster import Cluster, split_cores
from flowrl.runtime.session import Session
from flowrl.spec.loader import pipeline_from_dict
from tests.integration.conftest import tiny_grpo


def test_cores_are_split_into_consecutive_shares() -> None:
    assert split_cores([0, 1], 2) == [(0,), (1,)]
    assert split_cores([0, 1, 2, 3, 4], 2) == [(0, 1, 2), (3, 4)]
    with pytest.raises(ClusterError, match="runtime.pin_cpus"):
        split_cores([0, 1], 3)


@pytest.mark.integration
def test_pinned_slots_run_on_their_own_cores(tmp_path: Path) -> None:
    pipeline = tiny_grpo(tmp_path, steps=1).build()
    cluster = Cluster.start_local(2, pin_cpus=True)
    try:
        Session(cluster, pipeline, plan_for(pipeline, {"rollout": "cpu-0", "ref": "cpu-1"}), None)
        affinity = cluster.client.run(lambda: sorted(os.sched_getaffinity(0)))
        by_address = {slot.address: list(slot.cores or ()) for slot in cluster.slots}
    finally:
        cluster.close()
    assert affinity == by_address
    assert sorted(core for cores in by_address.values() for core in cores) == sorted(os.sched_getaffinity(0))


@pytest.mark.integration
def test_a_dynamic_run_reports_status_lines_smoothed_estimates_and_device_load(tmp_path: Path) -> None:
    spec = tiny_grpo(tmp_path / "out", steps=12).to_dict()
    spec["scheduler"] = {"policy": "dynamic", "every_steps": 5}
    spec["profiler"] = {"ewma_window": 3, "sample_interval_s": 0.1}
    result = run(pipeline_from_dict(spec))
    assert [r.step for r in result.records] == list(range(1, 13))

    events = [json.loads(line) for line in (tmp_path / "out" / "events.jsonl").read_text().splitlines()]
    status = [e for e in events if e["kind"] == "status"]
    assert [e["step"] for e in status] == [5, 10, 12]
    assert status[0]["message"].startswith("[STEP 5] gen ")
    assert "tok/s" in status[0]["message"]

    profile = [json.loads(line) for line in (tmp_path / "out" / "profile.jsonl").read_text().splitlines()]
    smoothed = [p for p in profile if p["type"] == "smoothed"]
    assert {p["node"] for p in smoothed} == {"rollout", "reward", "ref", "adv", "train"}
    assert {p["step"] for p in smoothed} == {5, 10, 12}
    nodes = [p for p in profile if p["type"] == "node"]
    assert len(nodes) == 12 * 5
    rollout = next(p for p in nodes if p["node"] == "rollout")
    assert rollout["tokens_out"] > 0 and rollout["compute_s"] <= rollout["wall_s"]
    devices = [p for p in profile if p["type"] == "device"]
    assert {p["device"] for p in devices} == {"cpu-0", "cpu-1"}
    assert all(0.0 <= p["external_load"] <= 1.0 for p in devices)


@pytest.mark.integration
def test_the_shipped_data_parallel_pipeline_trains_its_policy_over_two_workers(tmp_path: Path) -> None:
    from flowrl.spec.loader import load_pipeline

    graph = load_pipeline(Path(__file__).resolve().parents[2] / "pipelines" / "grpo_data_parallel.yaml")
    result = run(graph, steps=4, output_dir=tmp_path / "out")
    assert len(result.records) == 4
    plan = json.loads((tmp_path / "out" / "plan-0.json").read_text())["runtime"]
    assert plan["node_shards"]["train"] == ["cpu-0", "cpu-1"] or plan["node_shards"]["train"] == ["cpu-1", "cpu-0"]
    # both ranks report their part of every update
    train = [node for node in result.records[-1].nodes if node.node == "train"]
    assert sorted(node.device for node in train) == ["cpu-0", "cpu-1"]
