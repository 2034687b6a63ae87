"""A policy trained through LoRA adapters in a whole run: the generator on another worker
receives the adapters alone, the run learns, and a resumed run ends where an uninterrupted
one does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from flowrl.api.run import run
from flowrl.spec.loader import pipeline_from_dict
from tests.integration.conftest import StopAtStep, tiny_grpo

pytestmark = pytest.mark.integration

# tiny-llama: hidden 128, key/value width 128 (4 of 4 heads), MLP 512, 2 layers. A rank-r
# adapter of an in x out layer has r * (in + out) parameters: q, k, v, o 4 x 256 r, gate and
# up 2 x 640 r, down 640 r: 2944 r per layer, 5888 r in all; at rank 8, 47,104 fp32 numbers.
ADAPTER_PARAMETERS = 47_104


def _split(output: Path, steps: int, checkpoint_every: int = 0, lr: float = 5e-3) -> Any:
    """Generation on a worker of its own, the update on the other; the actor has adapters."""
    spec = tiny_grpo(output, steps=steps, kl_coef=0.0, checkpoint_every=checkpoint_every, lr=lr).to_dict()
    spec["models"]["actor"]["lora"] = {"rank": 8}
    spec["devices"]["gen_group"] = {"type": "cpu", "exclusive": True}
    spec["nodes"]["rollout"]["device_group"] = "gen_group"
    spec["models"].pop("reference")
    spec["devices"].pop("ref_group")
    return pipeline_from_dict(spec)


def test_adapters_alone_reach_the_generator_on_another_worker_and_the_run_learns(tmp_path: Path) -> None:
    result = run(_split(tmp_path / "out", steps=30))
    assert result.metric("perf/weight_sync_mb") == [pytest.approx(ADAPTER_PARAMETERS * 4 / 1e6)] * 30
    # the start-up log counts the adapters of the copy the update trains, not the generator's
    events = [json.loads(line) for line in (tmp_path / "out" / "events.jsonl").read_text().splitlines()]
    models = sorted(event["message"] for event in events if event["kind"] == "model")
    assert len(models) == 2, models
    assert sum(f"({ADAPTER_PARAMETERS:,} trainable, in adapters)" in message for message in models) == 1, models
    rewards = result.metric("critic/score/mean")
    assert sum(rewards[-6:]) / 6 > sum(rewards[:6]) / 6 + 0.05
    final = tmp_path / "out" / "final"
    adapter = load_file(str(final / "adapter" / "adapter_model.safetensors"))
    assert sum(t.numel() for t in adapter.values()) == ADAPTER_PARAMETERS
    assert all(key.startswith("base_model.model.") for key in adapter)
    # the final model is a plain one: no adapter names among its weights
    assert not any("lora_" in key or "base_layer" in key for key in load_file(str(final / "model.safetensors")))
    # and the adapter directory opens by itself, onto the base model it names
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(final)(input_ids=ids).logits
        adapted = AutoPeftModelForCausalLM.from_pretrained(final / "adapter")(input_ids=ids).logits
    torch.testing.assert_close(adapted, merged, atol=1e-5, rtol=0)


def test_a_resumed_run_with_adapters_ends_with_the_weights_of_an_uninterrupted_run(tmp_path: Path) -> None:
    run(_split(tmp_path / "whole", steps=6))

    stopped = tmp_path / "stopped"
    with pytest.raises(KeyboardInterrupt):
        run(_split(stopped, steps=6, checkpoint_every=3), observer=StopAtStep(4))  # checkpoint step-3 is on disk
    assert (stopped / "checkpoints" / "step-3" / "actor" / "adapter" / "adapter_model.safetensors").is_file()
    run(_split(stopped, steps=6, checkpoint_every=3), resume=True)
    for name in ("adapter/adapter_model.safetensors", "model.safetensors"):
        expected = load_file(str(tmp_path / "whole" / "final" / name))
        actual = load_file(str(stopped / "final" / name))
        assert expected.keys() == actual.keys()
        for key in expected:
            torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=1e-6)


def test_the_reference_as_the_actor_s_frozen_weights_trains_as_a_separate_reference_model(tmp_path: Path) -> None:
    """With adapters, ``ref: {model: actor}`` computes the log-probs of the actor's frozen
    weights: the run trains as one with a reference model of the same path, without that
    second copy of the model."""

    def pipeline(output: Path, own_reference: bool) -> Any:
        spec = tiny_grpo(output, steps=6, kl_coef=0.05, lr=5e-3, own_ref_worker=False).to_dict()
        spec["models"]["actor"]["lora"] = {"rank": 8}
        if not own_reference:
            spec["nodes"]["ref"]["model"] = "actor"
            spec["models"].pop("reference")
            spec["devices"].pop("ref_group", None)
        return pipeline_from_dict(spec)

    separate = run(pipeline(tmp_path / "separate", own_reference=True))
    shared = run(pipeline(tmp_path / "shared", own_reference=False))
    kl = shared.metric("actor/kl_loss")
    assert kl[0] == pytest.approx(0.0, abs=1e-6) and max(kl) > 1e-4  # the policy leaves its frozen weights
    assert kl == pytest.approx(separate.metric("actor/kl_loss"), rel=1e-4, abs=1e-7)
    for name in ("adapter/adapter_model.safetensors", "model.safetensors"):
        expected = load_file(str(tmp_path / "separate" / "final" / name))
        actual = load_file(str(tmp_path / "shared" / "final" / name))
        for key in expected:
            torch.testing.assert_close(actual[key], expected[key], rtol=1e-4, atol=1e-6)


def test_a_forced_resume_its_checkpoint_refuses_leaves_the_run_as_it_was(tmp_path: Path) -> None:
    """--force past a changed rank: the checkpoint's adapters do not fit, the resume is
    refused, and the run keeps the pipeline that trained it (a plain resume goes on)."""
    from flowrl.errors import CheckpointError, FlowrlError

    output = tmp_path / "out"

    def pipeline(steps: int, rank: int = 8) -> Any:
        spec = tiny_grpo(output, steps=steps, kl_coef=0.0, checkpoint_every=2, lr=5e-3).to_dict()
        spec["models"]["actor"]["lora"] = {"rank": rank}
        spec["models"].pop("reference")
        spec["devices"].pop("ref_group")
        return pipeline_from_dict(spec)

    run(pipeline(2))
    config = (output / "config.yaml").read_text()
    with pytest.raises(CheckpointError, match=r"other settings than models.actor.lora now \(rank: 8 -> 4; alpha: 16 -> 8\)"):
        run(pipeline(4, rank=4), resume=True, force=True)
    assert (output / "config.yaml").read_text() == config
    with pytest.raises(FlowrlError, match=r"\(before -> now\):\n  models.actor.lora.rank: 8 -> 4\n"):
        run(pipeline(4, rank=4), resume=True)  # compared with the pipeline that trained it, rank 8
    resumed = run(pipeline(4), resume=True)
    assert [record.step for record in resumed.records] == [3, 4]
