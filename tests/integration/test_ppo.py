"""The four-model PPO pipeline on a LocalCluster: critic, reward model, reference, GAE."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, LlamaForTokenClassification

from flowrl.api.run import run
from flowrl.backends.weight_files import read_weights
from flowrl.graph import PipelineGraph
from flowrl.spec.loader import load_pipeline, pipeline_from_dict

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_ppo_tiny_learns_with_critic_reward_model_and_kl_penalty(tmp_path: Path) -> None:
    pipeline = load_pipeline(ROOT / "pipelines" / "ppo_tiny.yaml")
    output = tmp_path / "out"
    result = run(pipeline, steps=40, output_dir=output)

    rewards = result.metric("critic/score/mean")
    # tiny-rm scores the share of digits; a random policy writes ~12 % digits
    assert sum(rewards[-8:]) / 8 > sum(rewards[:8]) / 8 + 0.1
    # the critic learns the returns: its loss falls
    losses = result.metric("critic/vf_loss")
    assert sum(losses[-8:]) / 8 < sum(losses[:8]) / 8
    # KL enters as a reward penalty with the fixed coefficient of the file
    assert result.metric("actor/reward_kl_penalty_coeff") == [0.02] * 40

    plan = json.loads((output / "plan-0.json").read_text())
    # four groups, two CPU slots of one machine: side by side the model nodes divide its cores
    # (flowrl/planner/sharing.py). The actor's chain stays on one slot (a reference apart is
    # predicted a fifth slower); the critic's group joins it or takes the other slot, as the
    # overheads measured at start put the two layouts within 10 % of each other or not
    slots = plan["runtime"]["node_slots"]
    assert slots["rollout"] == slots["ref"] == slots["train_actor"]
    assert slots["values"] == slots["train_critic"] and set(slots.values()) <= {"cpu-0", "cpu-1"}
    # final/ is the actor; the trained critic sits beside it, a token classifier transformers opens
    AutoModelForCausalLM.from_pretrained(output / "final")
    assert isinstance(AutoModelForTokenClassification.from_pretrained(output / "final" / "critic"), LlamaForTokenClassification)


def _ppo(output: Path, steps: int) -> PipelineGraph:
    data = yaml.safe_load((ROOT / "pipelines" / "ppo_tiny.yaml").read_text())
    data["trainer"].update(steps=steps, output_dir=str(output), checkpoint_every=2, max_shard_size="1MB")
    # both updates on a schedule, which a resume must take up where it stopped
    data["nodes"]["train_actor"].update(lr_schedule="cosine", lr_warmup_steps=1, min_lr_ratio=0.2)
    data["nodes"]["train_critic"].update(lr_schedule="linear", lr_decay_steps=3)
    return pipeline_from_dict(data)


def test_sharded_checkpoints_resume_to_the_weights_of_an_uninterrupted_run(tmp_path: Path) -> None:
    """tiny-llama is ~2 MB in fp32: with max_shard_size 1MB the actor and the critic are written
    in shards with an index, in the checkpoint and in final/, and a run resumed from the
    sharded checkpoint ends where an uninterrupted one does."""
    whole = tmp_path / "whole"
    rates = run(_ppo(whole, steps=4)).metric
    # actor: warm-up step 1 at half the peak, then a cosine from 5e-4 towards 1e-4 over 3
    # steps; critic: linear from 1e-3 to 0 over 3 steps, 0 from there on
    cosine = [0.5 * (1 + math.cos(math.pi * p)) for p in (0, 1 / 3, 2 / 3)]
    assert rates("actor/lr") == pytest.approx([2.5e-4] + [5e-4 * (0.2 + 0.8 * c) for c in cosine])
    assert rates("critic/lr") == pytest.approx([1e-3, 1e-3 * 2 / 3, 1e-3 / 3, 0.0], abs=1e-12)
    checkpoint = whole / "checkpoints" / "step-2"
    manifest = json.loads((checkpoint / "trainer_state.json").read_text())["files"]
    for model in ("actor", "critic"):
        shards = sorted(p.name for p in (checkpoint / model).glob("model-*-of-*.safetensors"))
        assert len(shards) > 1 and not (checkpoint / model / "model.safetensors").exists()
        for name in [*shards, "model.safetensors.index.json"]:
            assert f"{model}/{name}" in manifest  # sealed by the checkpoint's SHA-256 manifest

    # the folder as a run killed after its step-2 checkpoint leaves it: no final/, no last
    # step's checkpoint, not finished
    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed, ignore=shutil.ignore_patterns("final", "step-4"))
    info = json.loads((resumed / "run.json").read_text())
    (resumed / "run.json").write_text(json.dumps({**info, "finished_steps": None}))
    config = (resumed / "config.yaml").read_text().replace(str(whole), str(resumed))
    (resumed / "config.yaml").write_text(config)
    result = run(_ppo(resumed, steps=4), resume=True)
    assert [record.step for record in result.records] == [3, 4]
    assert result.metric("actor/lr") == pytest.approx(rates("actor/lr")[2:])

    for folder in ("final", "final/critic"):
        assert len(list((resumed / folder).glob("model-*-of-*.safetensors"))) > 1
        expected, actual = read_weights(whole / folder), read_weights(resumed / folder)
        assert expected.keys() == actual.keys()
        for key in expected:
            torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=1e-6)
    # transformers opens both as they are, shards and all
    opened = {
        "final": AutoModelForCausalLM.from_pretrained(resumed / "final"),
        "final/critic": AutoModelForTokenClassification.from_pretrained(resumed / "final" / "critic"),
    }
    for folder, model in opened.items():
        state = model.state_dict()
        for key, value in read_weights(resumed / folder).items():
            assert torch.equal(state[key], value), f"{folder}: {key}"


def test_the_evaluation_scores_held_out_completions_with_the_reward_model(tmp_path: Path) -> None:
    """A score node's reward model scores the held-out completions on its own worker: the same
    numbers whether it sits on the generation worker or fetches them from another."""
    held_out = tmp_path / "held.jsonl"
    held_out.write_text("".join(json.dumps({"prompt": f"{word}="}) + "\n"
                                for word in ("abcdefgh", "qwertyui", "zxcvbnml", "poiuytre", "lkjhgfds")))
    scores = {}
    for name, slots, separate in (("together", 2, False), ("apart", 4, True)):
        data = yaml.safe_load((ROOT / "pipelines" / "ppo_tiny.yaml").read_text())
        data["eval"] = {"source": str(held_out), "every_steps": 2, "n": 2, "temperature": 1.0}
        if separate:  # the reward model's group and the actor's on slots of their own
            data["devices"]["reward_group"]["exclusive"] = data["devices"]["actor_group"]["exclusive"] = True
        result = run(pipeline_from_dict(data), steps=2, output_dir=tmp_path / name, cpu_slots=slots)
        slots_of = json.loads((tmp_path / name / "plan-0.json").read_text())["runtime"]["node_slots"]
        assert (slots_of["reward"] != slots_of["rollout"]) is separate
        assert [step for step, _ in result.evaluations] == [0, 2]
        scores[name] = [metrics["val/reward/mean"] for _, metrics in result.evaluations]
        assert all(set(metrics) >= {"val/reward/mean", "val/reward/mean@2", "val/reward/num_failed"}
                   and "val/reward/pass@2" not in metrics for _, metrics in result.evaluations)
    # the reward model's threads differ between the layouts: fp32 sums may differ in the last bits
    assert scores["together"] == pytest.approx(scores["apart"], rel=1e-5)
    assert len(set(scores["together"])) == 2  # after two updates the policy's completions score otherwise
