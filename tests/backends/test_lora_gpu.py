"""Adapters on a GPU: the static decoder's captured graphs read the merged weights, refreshed
after each change of the adapters; a whole bf16 run trains through them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from flowrl.backends.lora import add_adapters, merged_weights
from flowrl.backends.static_decode import StaticDecoder
from tests.backends.test_static_decode import PAD_ID, build, frequent_token, left_padded

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Give every adapter's B (zero at the start) random values, in place."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".lora_B." in name:
                parameter.copy_(torch.randn(parameter.shape, device="cuda", generator=generator) * 0.3)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_captured_graphs_decode_with_the_merged_weights_and_follow_the_adapters(kind: str) -> None:
    """fp32 so argmax ties cannot flip: greedy tokens of the adapted model's decoder equal a
    plain model's holding the merged weights, before and after the adapters change in place."""
    torch.backends.cuda.matmul.allow_tf32 = False
    adapted = build(kind, "cuda")
    add_adapters(adapted, rank=4, alpha=8, target_modules="all-linear")
    decoder = StaticDecoder(adapted)
    assert decoder.use_graphs
    ids, mask = left_padded([1 + (row * 5) % 8 for row in range(24)], seed=6, device="cuda")
    for seed in (1, 2):  # the second changes the adapters after graphs were captured
        _perturb(adapted, seed)
        plain = build(kind, "cuda")
        plain.load_state_dict(merged_weights(adapted))
        eos = frequent_token(plain, ids, mask)
        expected = StaticDecoder(plain).generate(ids, mask, 24, eos_token_id=eos, pad_token_id=PAD_ID, greedy=True)
        for _ in range(2):  # capture, then replay
            out = decoder.generate(ids, mask, 24, eos_token_id=eos, pad_token_id=PAD_ID, greedy=True)
            assert torch.equal(out.completion_ids, expected.completion_ids)


def test_a_bf16_run_with_adapters_trains_on_the_gpu(tmp_path: Path) -> None:
    """The GPU pipeline with adapters on the actor: compiled layers and the fused head train
    the adapters; the decoder's merged weights keep the sampling and training log-probs close."""
    from flowrl.api.run import run
    from flowrl.spec.loader import pipeline_from_dict

    pipeline = Path(__file__).resolve().parents[2] / "pipelines" / "grpo_tiny_gpu.yaml"
    spec = yaml.safe_load(pipeline.read_text())
    spec["models"]["actor"]["lora"] = {"rank": 8}
    spec["nodes"]["train"]["lr"] = 5e-3
    spec["trainer"].update(steps=12, output_dir=str(tmp_path / "out"))
    result = run(pipeline_from_dict(spec))
    plan = json.loads((tmp_path / "out" / "plan-0.json").read_text())["runtime"]
    assert plan["model_slots"]["actor"] == ["gpu-0"]
    assert all(torch.isfinite(torch.tensor(r.metrics["actor/loss"])) for r in result.records)
    # bf16 sampling against the training pass: a decoder that missed the adapters would drift
    # as they grow; with them merged the drift stays at bf16 rounding
    assert max(result.metric("actor/rollout_logprob_diff")) < 0.05
    assert (tmp_path / "out" / "final" / "adapter" / "adapter_model.safetensors").is_file()
