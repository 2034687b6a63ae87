"""Generate and update of one model on different workers: new weights reach the generator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowrl.api.run import run

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("weight_sync", ["call", "collective"])
def test_generator_on_another_worker_learns_through_pushed_weights(tmp_path: Path, make_pipeline,
                                                                   weight_sync: str) -> None:
    """``call``: the trainer's worker sends the weights to the generating one; ``collective``:
    a broadcast over a gloo group of the two (on GPU workers, NCCL)."""
    pipeline = make_pipeline(tmp_path / "out", steps=30, kl_coef=0.0)
    # Sample on the second worker while the update stays on the first: the only way the
    # sampled completions can improve is the weights pushed after every update.
    spec = pipeline.to_dict()
    spec["devices"]["gen_group"] = {"type": "cpu", "exclusive": True}
    spec["nodes"]["rollout"]["device_group"] = "gen_group"
    spec["models"].pop("reference")
    spec["devices"].pop("ref_group")
    spec.setdefault("runtime", {})["weight_sync"] = weight_sync
    from flowrl.spec.loader import pipeline_from_dict

    result = run(pipeline_from_dict(spec))
    plan = json.loads((tmp_path / "out" / "plan-0.json").read_text())
    assert plan["runtime"]["node_slots"]["rollout"] != plan["runtime"]["node_slots"]["train"]
    assert sorted(plan["runtime"]["model_slots"]["actor"]) == ["cpu-0", "cpu-1"]

    # tiny-llama in fp32: 546,176 parameters x 4 bytes to one peer
    assert result.metric("perf/weight_sync_mb") == [pytest.approx(546_176 * 4 / 1e6)] * 30
    assert result.metric("perf/weight_sync_collective") == [1.0 if weight_sync == "collective" else 0.0] * 30
    rewards = result.metric("critic/score/mean")
    assert sum(rewards[-6:]) / 6 > sum(rewards[:6]) / 6 + 0.1
