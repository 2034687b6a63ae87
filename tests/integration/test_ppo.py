"""The four-model PPO pipeline on a LocalCluster: critic, reward model, reference, GAE."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from flowrl.api.run import run
from flowrl.spec.loader import load_pipeline

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
    assert result.metric("critic/kl_coef") == [0.02] * 40

    plan = json.loads((output / "plan-0.json").read_text())
    # four groups on two CPU slots: they share round-robin
    assert set(plan["runtime"]["node_slots"].values()) == {"cpu-0", "cpu-1"}
    # final/ is the actor; the trained critic sits beside it
    AutoModelForCausalLM.from_pretrained(output / "final")
    assert (output / "final" / "critic" / "value_head.safetensors").exists()
