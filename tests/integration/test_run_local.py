"""A real run on an embedded LocalCluster: it learns and leaves a complete output folder."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from flowrl.api.run import run
from flowrl.spec.loader import load_pipeline

pytestmark = pytest.mark.integration


def test_grpo_on_local_cluster_learns_and_writes_outputs(tmp_path: Path, make_pipeline) -> None:
    output = tmp_path / "out"
    pipeline = make_pipeline(output, steps=40, checkpoint_every=10, own_ref_worker=False)
    result = run(pipeline)

    rewards = result.metric("critic/score/mean")
    assert len(rewards) == 40
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    # The digits reward starts near the share of digits a random policy emits (~0.12);
    # 40 GRPO steps at lr 5e-4 move it well above that.
    assert last > first + 0.15, (first, last)

    # metrics.jsonl: one line per step, steps 1..40 in order, verl names present
    lines = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 41))
    for name in ("timing_s/gen", "timing_s/ref", "timing_s/update_actor", "timing_s/step", "perf/throughput",
                 "actor/kl_loss", "actor/pg_clipfrac", "actor/ppo_kl", "perf/total_num_tokens", "perf/time_per_step"):
        assert name in lines[-1], name
    last_line = lines[-1]
    assert last_line["perf/time_per_step"] == last_line["timing_s/step"]
    # generation per generated token; the others per prompt + response token of the step
    profile = [json.loads(line) for line in (output / "profile.jsonl").read_text().splitlines()]
    generated = sum(entry["tokens_out"] for entry in profile
                    if entry["step"] == 40 and entry["type"] == "node" and entry["role"] == "generate")
    assert last_line["timing_per_token_ms/gen"] == pytest.approx(last_line["timing_s/gen"] * 1000 / generated, rel=1e-6)
    assert last_line["timing_per_token_ms/ref"] == pytest.approx(
        last_line["timing_s/ref"] * 1000 / last_line["perf/total_num_tokens"], rel=1e-6)

    # samples.jsonl: the rollout's first 4 rows of every 10th step, with the digits reward of
    # each completion (a share of its characters, recomputed here) and its GRPO advantage
    from flowrl.rewards.builtin import digit_match

    samples = [json.loads(line) for line in (output / "samples.jsonl").read_text().splitlines()]
    assert [(sample["step"], sample["row"]) for sample in samples] == [(s, r) for s in (10, 20, 30, 40) for r in range(4)]
    for sample in samples:
        assert sample["prompt"] and sample["answer"] is None and set(sample["rewards"]) == {"reward"}
        assert sample["rewards"]["reward"] == pytest.approx(digit_match([sample["completion"]], 16)[0])
        assert math.isfinite(sample["advantage"])

    # config.yaml is the resolved pipeline, its output folder made absolute: it loads back
    # to an equal one
    saved = load_pipeline(output / "config.yaml")
    assert saved.spec.trainer.output_dir == str(output.resolve())
    built = pipeline.build().spec
    assert saved.spec.model_copy(update={"trainer": built.trainer}) == built

    # the plan puts the reference next to the actor (rollout -> ref -> train is a chain, so a
    # second worker would only add transfers); where the score and the advantage go depends on
    # the CPU rates measured at start (on 2 cores: next to them too)
    plan = json.loads((output / "plan-0.json").read_text())
    assert plan["iteration_s"] > 0 and plan["critical_path"][0] == "rollout"
    # predicted and measured side by side: per node the median of its steps' compute seconds
    import statistics

    assert plan["measured"]["steps"] == [1, 40]
    for entry in plan["nodes"]:
        seconds = [call["compute_s"] for call in profile if call["type"] == "node" and call["node"] == entry["node"]
                   and 1 <= call["step"] <= 40]
        assert entry["measured_s"] == pytest.approx(statistics.median(seconds)), entry["node"]
        assert entry["predicted_s"] == pytest.approx(entry["end_s"] - entry["start_s"])
    slots = plan["runtime"]["node_slots"]
    assert set(slots.values()) <= set(plan["measured"]["devices"]) <= {"cpu-0", "cpu-1"}
    assert plan["shared"] == {"ref_group": "actor_group"}
    assert slots["rollout"] == slots["ref"] == slots["train"]
    # calibrated: per-node factors learned on steps 2-20 (step 1 pays for lazy start-up), the
    # placement simulated again with them, beside the medians of steps 21-40
    calibrated = plan["calibrated"]
    assert calibrated["learned_from_steps"] == [2, 20] and calibrated["judged_on_steps"] == [21, 40]
    for node, entry in calibrated["nodes"].items():
        later = [call["compute_s"] for call in profile if call["type"] == "node" and call["node"] == node
                 and 21 <= call["step"] <= 40]
        assert entry["measured_s"] == pytest.approx(statistics.median(later)), node
        learned = [call["compute_s"] for call in profile if call["type"] == "node" and call["node"] == node
                   and 2 <= call["step"] <= 20]
        # the factor is the median of measured / predicted over the learning steps, so the
        # calibrated prediction is (up to the call overhead's share) their median
        assert entry["predicted_s"] == pytest.approx(statistics.median(learned), rel=0.05), node

    # checkpoints every 10 steps and at the last, the last 2 kept, each complete
    kept = sorted(p.name for p in (output / "checkpoints").iterdir())
    assert kept == ["step-30", "step-40"]
    assert (output / "checkpoints" / "step-40" / "actor" / "state.pt").exists()
    trainer_state = json.loads((output / "checkpoints" / "step-40" / "trainer_state.json").read_text())
    assert (trainer_state["step"], trainer_state["kl"]) == (40, {})
    assert "actor/model.safetensors" in trainer_state["files"] and "actor/state.pt" in trainer_state["files"]

    # final/ is the trained actor, loadable with from_pretrained, and it differs from the start
    model = AutoModelForCausalLM.from_pretrained(output / "final")
    tokenizer = AutoTokenizer.from_pretrained(output / "final")
    assert tokenizer.decode(tokenizer("ab=12", add_special_tokens=False)["input_ids"]) == "ab=12"
    start = AutoModelForCausalLM.from_pretrained(output / "checkpoints" / "step-30" / "actor")
    assert any((a - b).abs().max() > 0 for a, b in zip(model.parameters(), start.parameters()))

    events = [json.loads(line)["kind"] for line in (output / "events.jsonl").read_text().splitlines()]
    # what the data is comes first (read before any worker starts), then the cluster
    assert events[0] == "data" and events[1] == "cluster" and "placement" in events and events[-1] == "final"
