"""The cost model against hand computations on a toy shape and on published model sizes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from flowrl.errors import PlacementError
from flowrl.planner.cost import (
    KNOWN_SHAPES,
    ModelShape,
    FUSED_CHUNK_ELEMENTS,
    fused_chunk_rows,
    activation_bytes,
    adapter_parameters,
    decoder_cache_bytes,
    forward_flops,
    kv_cache_bytes,
    logits_bytes,
    measure_cpu_rates,
    resolve_shape,
    shape_from_config,
    shared_prompt_flops,
    sharded_training_bytes,
    training_state_bytes,
    weight_bytes,
)

# L=2 layers, h=8, H=2 heads (head size 4), 2 kv heads, I=16, V=10, untied head
TOY = ModelShape(num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=2,
                 intermediate_size=16, vocab_size=10)


def test_parameters_of_the_toy_shape() -> None:
    # kv width = 2 heads * 4 = 8
    # one layer: q,o 2*8*8=128; k,v 2*8*8=128; MLP 3*8*16=384; two norms 2*8=16 -> 656
    assert TOY.layer_parameters() == 656
    # embedding 10*8=80 + layers 2*656=1312 + final norm 8 + head 8*10=80 = 1480
    assert TOY.num_parameters("policy") == 1480
    # a value model has a scalar head: 80 + 1312 + 8 + 8*1 = 1408
    assert TOY.num_parameters("value") == 1408
    # M (what a token multiplies): layers 1312 + head 80 = 1392
    assert TOY.matmul_parameters("policy") == 1392


def test_flops_and_memory_of_the_toy_shape() -> None:
    # 3 sequences of 5 tokens: T = 15
    # dense 2*M*T = 2*1392*15 = 41760; attention 4*L*h*s*T = 4*2*8*5*15 = 4800
    assert forward_flops(TOY, "policy", 3, 5) == 41760 + 4800
    # 4 rows in groups of 2 sharing prompts of 2 tokens, completions of 3: 2 prompts of 2
    # tokens and 4 completions of 3 go through the layers, 16 tokens instead of 20:
    # dense 2*1392*16 = 44544; attention 4*L*h = 64 per token and context: completions
    # 64*5*12 = 3840, prompts 64*2*4 = 512
    assert shared_prompt_flops(TOY, "policy", 4, 2, 2, 3) == 44544 + 3840 + 512
    # weights fp32: 1480*4 = 5920 bytes; bf16 1480*2 = 2960
    assert weight_bytes(TOY, "policy", "fp32") == 5920
    assert weight_bytes(TOY, "policy", "bf16") == 2960
    # gradients + two AdamW moments = 3 * weights = 17760
    assert training_state_bytes(1480, "fp32") == 17760
    # bf16: gradients 2 bytes, then an fp32 master and two fp32 moments 12: 1480 * 14 = 20720
    assert training_state_bytes(1480, "bf16") == 20720
    # adapters add their own weights: fp32 4 + 4 + 8, bf16 2 + 2 + 12, 16 bytes either way
    assert training_state_bytes(100, "fp32", adapters=True) == 1600
    assert training_state_bytes(100, "bf16", adapters=True) == 1600
    # KV cache: per token 2 (k,v) * L 2 * kv 8 * 4 bytes = 128; 15 tokens -> 1920
    assert kv_cache_bytes(TOY, "fp32", 3, 5) == 1920
    # activations per token and layer, fp32: 4*(8h + 4I + 2kv) = 4*(64 + 64 + 16) = 576;
    # one layer of 15 tokens 8640, two layers 17280
    assert activation_bytes(TOY, "fp32", 3, 5, checkpointing=False) == 2 * 8640
    # bf16 adds RMSNorm's fp32 copies (4h = 32): 2*144 + 32 = 320 per token and layer
    assert activation_bytes(TOY, "bf16", 3, 5, checkpointing=False) == 2 * 15 * 320
    # checkpointing keeps layer inputs L*T*h*b = 2*15*8*4 = 960, plus one layer recomputed
    assert activation_bytes(TOY, "fp32", 3, 5, checkpointing=True) == 960 + 8640


def test_output_head_and_generation_memory_of_the_toy_shape() -> None:
    # the fused head holds one chunk: rows = max(64, 2**26 // 10) = 6710886, capped by the 15
    # tokens; per logit bf16 2 + fp32 4 (+ fp32 gradient 4 when training)
    assert logits_bytes(TOY, "policy", 15, "bf16") == 15 * 10 * 6
    # training: + the fp32 gradient of the 15 tokens' hidden states (8 each), summed over chunks
    assert logits_bytes(TOY, "policy", 15, "bf16", training=True) == 15 * 10 * 10 + 15 * 8 * 4
    # a scalar head: fp32 per token
    assert logits_bytes(TOY, "value", 15, "bf16") == 60
    # the decoder keeps: KV 1920 (fp32, above) + noise 3 rows * 10 * 4 = 120 + stacked
    # q/k/v and gate/up, L*(h*(h + 2kv) + 2*h*I) = 2*(8*24 + 256) = 896 numbers * 4 bytes
    assert decoder_cache_bytes(TOY, "policy", "fp32", 3, 5) == 1920 + 120 + 3584


def test_sharded_training_memory_of_the_toy_shape() -> None:
    # over 4 devices each keeps a quarter of parameters, gradients and two moments:
    # 4 * 5920 / 4 = 5920 bytes (a whole trainable copy keeps 5920 + 17760 = 23680)
    resident, gathered = sharded_training_bytes(TOY, "policy", "fp32", 4)
    assert resident == 5920
    # gathered at once: one layer (656) and the outer unit (1480 - 2*656 = 168: embedding 80,
    # final norm 8, head 80), parameters and gradients, 4 bytes each: 2 * 4 * 824 = 6592
    assert gathered == 6592
    assert sharded_training_bytes(TOY, "policy", "fp32", 2)[0] == 11840
    # bf16: a quarter of parameters (2), gradients (2), master and moments (12): 1480 * 16 / 4
    assert sharded_training_bytes(TOY, "policy", "bf16", 4)[0] == 5920


def test_the_fused_head_chunk_is_the_one_the_log_probs_use() -> None:
    from flowrl.algorithms.logprobs import FUSED_CHUNK_ELEMENTS as used
    from flowrl.algorithms.logprobs import fused_chunk_rows as rows_used

    assert FUSED_CHUNK_ELEMENTS == used
    # 2^26 / 32000 = 2097.2 -> 2097; / 151936 = 441.7 -> 441; / 10^6 = 67; / 2^21 = 32 -> 64 (the least)
    assert [fused_chunk_rows(v) for v in (32000, 151936, 10 ** 6, 2 ** 21, 64)] == [2097, 441, 67, 64, 1048576]
    assert [rows_used(v) for v in (32000, 151936, 10 ** 6, 64, 1000)] == [
        fused_chunk_rows(v) for v in (32000, 151936, 10 ** 6, 64, 1000)]


@pytest.mark.parametrize(("dtype", "kind", "compiled"), [
    ("fp32", "float32", False), ("bf16", "bfloat16", False), ("bf16", "bfloat16", True)])
def test_activation_bytes_are_what_a_qwen2_layer_saves_for_backward(dtype: str, kind: str, compiled: bool) -> None:
    """Count the bytes autograd saves (distinct storages, not the parameters) in a 1- and a
    3-layer Qwen2 stack: their difference over two layers is one layer's per-token share.
    Compiled: each layer behind torch.compile with the partitioner inductor uses (min-cut
    recomputation) but no code generation, so it runs on any machine."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = ModelShape(num_layers=1, hidden_size=128, num_heads=4, num_kv_heads=2,
                       intermediate_size=352, vocab_size=50)

    def saved(layers: int) -> int:
        config = Qwen2Config(hidden_size=128, num_hidden_layers=layers, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=352, vocab_size=50,
                             attn_implementation="sdpa")
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).to(getattr(torch, kind))
        if compiled:
            torch._dynamo.reset()
            for layer in model.model.layers:
                layer._compiled_call_impl = torch.compile(layer._call_impl, backend="aot_eager_decomp_partition")
        ids = torch.randint(0, 50, (2, 16))
        model.model(input_ids=ids, attention_mask=torch.ones_like(ids))  # compiles, saves nothing counted
        storages: dict[int, int] = {}

        def keep(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            model.model(input_ids=ids, attention_mask=torch.ones_like(ids))
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        return sum(size for pointer, size in storages.items() if pointer not in weights)

    per_token_layer = (saved(3) - saved(1)) / 2 / 32
    expected = activation_bytes(shape, dtype, 2, 16, False, compiled=compiled) / 32
    assert per_token_layer == pytest.approx(expected, rel=0.02)


@pytest.mark.parametrize(
    ("name", "published"),
    [
        ("Qwen/Qwen2.5-0.5B", 494_032_768),  # model card; includes q/k/v biases we skip
        ("meta-llama/Meta-Llama-3-8B", 8_030_261_248),
    ],
)
def test_known_shapes_match_published_sizes(name: str, published: int) -> None:
    assert KNOWN_SHAPES[name].num_parameters() == pytest.approx(published, rel=0.001)


def test_builtin_shapes_are_the_catalog_s_and_the_catalog_builds_what_it_says() -> None:
    from flowrl.backends.builtin import model_config
    from flowrl.backends.catalog import BUILTIN_MODELS, CHAR_VOCAB_SIZE
    from flowrl.backends.tokenizer import char_vocab

    assert CHAR_VOCAB_SIZE == len(char_vocab())
    for name, model in BUILTIN_MODELS.items():
        shape = KNOWN_SHAPES[f"builtin:{name}"]
        config = model_config(model, model.vocabulary, 0, 1, 2)
        assert (shape.num_layers, shape.hidden_size, shape.num_heads, shape.num_kv_heads,
                shape.intermediate_size, shape.vocab_size, shape.tie_embeddings) == (
            config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.vocab_size, config.tie_word_embeddings), name


def test_a_model_that_transforms_its_logits_holds_every_tokens_logits() -> None:
    config = {"hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 2, "intermediate_size": 16,
              "vocab_size": 2**20}
    plain = shape_from_config(config)
    capped = shape_from_config({**config, "final_logit_softcapping": 30.0})  # Gemma 2
    assert plain.plain_logits and not capped.plain_logits
    assert shape_from_config({**config, "logit_scale": 1.0}).plain_logits  # a scale of 1 changes nothing
    # the fused head's chunk: max(64, 2**26 // 2**20) = 64 of the 1000 tokens; bf16 2 + fp32 4
    assert logits_bytes(plain, "policy", 1000, "bf16") == 64 * 2**20 * 6
    assert logits_bytes(capped, "policy", 1000, "bf16") == 1000 * 2**20 * 6


def test_shape_from_a_local_config_and_instruct_names(tmp_path: Path) -> None:
    config = {"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2,
              "intermediate_size": 16, "vocab_size": 10}
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    assert resolve_shape("model", tmp_path) == TOY
    assert resolve_shape("Qwen/Qwen2.5-7B-Instruct") == KNOWN_SHAPES["Qwen/Qwen2.5-7B"]
    with pytest.raises(PlacementError, match="cannot size model 'org/unknown'"):
        resolve_shape("org/unknown", tmp_path)


def test_cpu_probe_returns_positive_rates() -> None:
    rates = measure_cpu_rates(matrix_size=32, repeats=1)
    assert rates.flops_per_s > 0 and rates.bandwidth_gbs > 0


def test_cpu_probe_keeps_the_one_thread_rate_when_the_parallel_matmul_stalls(monkeypatch: pytest.MonkeyPatch) -> None:
    # Busy cores: the BLAS library's own threads take 1 s per matmul, one thread 1 ms. On a
    # clock that only the matmuls advance, 2 x 256^3 FLOP in 1 ms is the rate kept.
    import contextlib

    import numpy
    import threadpoolctl

    import flowrl.planner.cost as cost

    clock = [0.0]
    limit: list[int | None] = [None]

    @contextlib.contextmanager
    def limits(limits: int | None = None) -> object:
        limit[0] = limits
        yield None
        limit[0] = None

    real_matmul = numpy.matmul

    def matmul(left: object, right: object) -> object:
        clock[0] += 1e-3 if limit[0] == 1 else 1.0
        return real_matmul(left, right)

    monkeypatch.setattr(threadpoolctl, "threadpool_limits", limits)
    monkeypatch.setattr(numpy, "matmul", matmul)
    monkeypatch.setattr(cost.time, "perf_counter", lambda: clock[0])
    rates = measure_cpu_rates(matrix_size=256, repeats=2)
    assert rates.flops_per_s == pytest.approx(2 * 256**3 / 1e-3)


def test_a_data_parallel_update_pays_a_ring_all_reduce_over_its_slowest_link() -> None:
    from flowrl.planner.cost import weight_bytes
    from flowrl.planner.costs import EstimatedCosts
    from flowrl.spec.loader import pipeline_from_dict
    from tests.planner.conftest import gpu, grpo

    spec = grpo({"path": "builtin:tiny-llama", "device_group": "actor_group"},
                {"path": "builtin:tiny-llama", "device_group": "ref_group"},
                {"actor_group": {"type": "gpu", "count": 2}, "ref_group": {"type": "gpu"}},
                ppo_epochs=2, mini_batch_size=8)
    costs = EstimatedCosts(pipeline_from_dict(spec))
    work = costs.work("train")
    assert work.shape is not None
    same_host = [gpu(0, "A100", 40.0, 312.0, 1555.0), gpu(1, "A100", 40.0, 312.0, 1555.0)]
    two_hosts = [gpu(0, "A100", 40.0, 312.0, 1555.0), gpu(1, "A100", 40.0, 312.0, 1555.0, host="node-1")]
    grads = weight_bytes(work.shape, work.kind, work.dtype)
    # two ranks: each sends and receives 2 * (2 - 1) / 2 = 1x the gradients per optimizer step;
    # PCIe inside a host (25 GB/s, 0.5 ms) against the network between hosts (12.5 GB/s, 1 ms)
    steps = work.num_mini_batches * work.ppo_epochs
    assert steps == 4  # 16 sequences in mini-batches of 8, two epochs
    expected = steps * ((1e-3 + grads / 12.5e9) - (5e-4 + grads / 25e9))
    difference = costs.compute_s("train", two_hosts, False) - costs.compute_s("train", same_host, False)
    assert difference == pytest.approx(expected)


def test_log_prob_passes_on_a_cpu_compute_each_group_s_prompt_once() -> None:
    from flowrl.planner.costs import EstimatedCosts
    from flowrl.spec.loader import pipeline_from_dict
    from tests.planner.conftest import cpu, gpu, grpo

    tiny = "builtin:tiny-llama"
    spec = grpo({"path": tiny, "device_group": "actor_group"}, {"path": tiny, "device_group": "ref_group"},
                {"actor_group": {"type": "cpu"}, "ref_group": {"type": "cpu"}}, batch_size=4, n=4)
    costs = EstimatedCosts(pipeline_from_dict(spec))
    ref, train, rollout = costs.work("ref"), costs.work("train"), costs.work("rollout")
    assert ref.group_size == train.group_size == rollout.group_size == 4
    assert ref.shares_prompts(on_cpu=True) and train.shares_prompts(on_cpu=True)
    assert not ref.shares_prompts(on_cpu=False)  # on a GPU the passes stay padded or packed
    assert not rollout.shares_prompts(on_cpu=True)  # generation prefills once on any device
    assert ref.shape is not None
    prompt, response = ref.prompt_tokens, ref.response_tokens
    # the reference's time on a CPU slot drops by exactly the FLOPs left out, at the slot's rate
    from dataclasses import replace

    saved = (forward_flops(ref.shape, "policy", 16, prompt + response)
             - shared_prompt_flops(ref.shape, "policy", 16, 4, prompt, response))
    ungrouped = replace(ref, group_size=1)
    assert saved > 0
    assert costs._on_device(ungrouped, cpu(0), 1)[0] - costs._on_device(ref, cpu(0), 1)[0] == pytest.approx(
        saved / costs.cpu_rates.flops_per_s)
    a100 = gpu(0, "A100", 40.0, 312.0, 1555.0)
    assert costs._on_device(ungrouped, a100, 1) == costs._on_device(ref, a100, 1)
    # generation prefills the 4 prompts, not the 16 rows
    prefill_saved = forward_flops(ref.shape, "policy", 16, prompt) - forward_flops(ref.shape, "policy", 4, prompt)
    assert costs._on_device(replace(rollout, group_size=1), cpu(0), 1)[0] - costs._on_device(rollout, cpu(0), 1)[0] == (
        pytest.approx(prefill_saved / costs.cpu_rates.flops_per_s))
    # shuffled mini-batches break the groups: the update is costed padded again
    shuffled = EstimatedCosts(pipeline_from_dict(grpo(
        {"path": tiny, "device_group": "actor_group"}, {"path": tiny, "device_group": "ref_group"},
        {"actor_group": {"type": "cpu"}, "ref_group": {"type": "cpu"}}, batch_size=4, n=4, mini_batch_size=8)))
    assert not shuffled.work("train").shares_prompts(on_cpu=True)
    assert shuffled.compute_s("train", [cpu(0)], False) > costs.compute_s("train", [cpu(0)], False)


def test_adapter_parameters_of_builtin_tiny_llama() -> None:
    shape = resolve_shape("builtin:tiny-llama")
    assert (shape.num_layers, shape.hidden_size, shape.kv_width, shape.intermediate_size) == (2, 128, 128, 512)
    # a linear layer of in x out gets rank * (in + out); rank 8, h = 128, kv width = 4 heads * 32 = 128, I = 512:
    # q, k, v, o 4 * 8 * (128 + 128) = 8192; gate, up 2 * 8 * (128 + 512) = 10240; down 8 * (512 + 128) = 5120
    # -> 23552 per layer, 2 layers: 47104
    assert adapter_parameters(shape, 8, "all-linear") == 47104
    # q, v: 2 * 8 * (128 + 128) = 4096 per layer, 2 layers: 8192
    assert adapter_parameters(shape, 8, ["q_proj", "v_proj"]) == 8192


def test_adapter_parameters_are_what_peft_adds_to_a_grouped_query_model() -> None:
    """k and v are narrower than q with grouped-query attention: the count must size each."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from flowrl.backends.lora import add_adapters

    config = LlamaConfig(vocab_size=10, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=1, intermediate_size=96)
    shape = shape_from_config(config.to_dict())
    assert shape.kv_width == 16
    for targets in ("all-linear", ["q_proj", "v_proj"], ["k_proj", "down_proj"]):
        model = LlamaForCausalLM(config)
        add_adapters(model, 4, 8, targets)
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert adapter_parameters(shape, 4, targets) == trained, targets
    # all-linear by hand: q, o 2 * 4 * (64 + 64) = 1024; k, v 2 * 4 * (64 + 16) = 640;
    # gate, up, down 3 * 4 * (64 + 96) = 1920 -> 3584 per layer, 7168
    assert adapter_parameters(shape, 4, "all-linear") == 7168


def test_the_costs_of_a_model_with_adapters() -> None:
    """Training state for the adapters alone, a backward of one forward's FLOPs, and merged
    copies of the layers' weights for the static decoder."""
    from flowrl.planner.costs import CALL_OVERHEAD_S, EstimatedCosts
    from flowrl.spec.loader import pipeline_from_dict
    from tests.planner.conftest import gpu, grpo

    def costs(lora: dict[str, Any] | None) -> EstimatedCosts:
        actor = {"path": "builtin:tiny-llama", "device_group": "actor_group", **({"lora": lora} if lora else {})}
        return EstimatedCosts(pipeline_from_dict(grpo(
            actor, {"path": "builtin:tiny-llama", "device_group": "ref_group"},
            {"actor_group": {"type": "gpu"}, "ref_group": {"type": "gpu"}})))

    plain, adapted = costs(None), costs({"rank": 8})
    work = adapted.work("train")
    assert work.adapter_parameters == 47104 and work.dtype == "fp32" and work.shape is not None
    assert plain.work("train").adapter_parameters == 0 and adapted.work("ref").adapter_parameters == 0
    # fp32 weights, gradients and two AdamW moments of the 47104 adapter parameters: 16 * 47104 bytes;
    # the model's own weights are held as before
    assert adapted.memory("train", 1, gpu=True).state_gb == pytest.approx(16 * 47104 / 1e9)
    assert adapted.memory("train", 1, gpu=True).weights_gb == plain.memory("train", 1, gpu=True).weights_gb
    # generation keeps merged copies of the adapted output and down projections (it merges q, k,
    # v, gate and up into the stacked copies it has anyway): 2 layers * (128 * 128 + 512 * 128)
    # parameters * 4 bytes
    assert adapted.memory("rollout", 1, gpu=True).cache_gb - plain.memory("rollout", 1, gpu=True).cache_gb == (
        pytest.approx(2 * (128 * 128 + 512 * 128) * 4 / 1e9))
    # of q in one layer given by its index and v in both: no merged copies at all
    one = costs({"rank": 8, "target_modules": ["model.layers.1.self_attn.q_proj", "v_proj"]})
    assert one.work("rollout").adapted_parameters == 0
    assert one.work("train").adapter_parameters == 8 * 256 + 2 * 8 * 256
    # two layers named one by one add up; a name without an index covers every layer
    two = costs({"rank": 8, "target_modules": ["layers.0.self_attn.q_proj", "layers.1.self_attn.q_proj"]})
    assert two.work("train").adapter_parameters == 2 * 8 * 256
    both = costs({"rank": 8, "target_modules": ["layers.0.self_attn.q_proj", "q_proj"]})
    assert both.work("train").adapter_parameters == 2 * 8 * 256
    # a step: 2 passes (forward, and a backward of one forward's FLOPs: the frozen weights get
    # no gradients) with 2 layers' launches each, and AdamW's fp32 traffic of 28 bytes per
    # adapter parameter
    a100 = gpu(0, "A100", 40.0, 312.0, 1555.0)
    flops_per_s, bytes_per_s, overheads = adapted._rates(a100, "fp32")
    layer_s = overheads.forward_layer_s
    pass_flops = forward_flops(work.shape, "policy", work.num_sequences, work.prompt_tokens + work.response_tokens)
    steps = work.num_mini_batches * (47104 * 28 / bytes_per_s + 2 * 2 * layer_s)
    expected = CALL_OVERHEAD_S + work.ppo_epochs * (2 * pass_flops / flops_per_s + steps)
    assert adapted.compute_s("train", [a100], False) == pytest.approx(expected)


def test_a_cpu_slot_s_overheads_are_paid_per_layer_and_per_pass_or_step() -> None:
    # 16 rows of tiny-llama (2 layers) on a CPU slot: the reference in passes of 4 rows, the
    # update in passes of 8; the difference to zero overheads is each overhead times its count
    from dataclasses import replace

    from flowrl.planner.cost import CpuRates, Overheads
    from flowrl.planner.costs import EstimatedCosts
    from flowrl.spec.loader import pipeline_from_dict
    from tests.planner.conftest import cpu, grpo

    tiny = "builtin:tiny-llama"
    spec = grpo({"path": tiny, "device_group": "actor_group"}, {"path": tiny, "device_group": "ref_group"},
                {"actor_group": {"type": "cpu"}, "ref_group": {"type": "cpu"}}, batch_size=4, n=4)
    plain = EstimatedCosts(pipeline_from_dict(spec), cpu_rates=CpuRates(overheads=Overheads(0.0, 0.0, 0.0)))
    row_tokens = plain.work("ref").prompt_tokens + plain.work("ref").response_tokens
    spec["nodes"]["ref"]["micro_batch_tokens"] = 4 * row_tokens
    spec["nodes"]["train"]["micro_batch_tokens"] = 8 * row_tokens
    overheads = Overheads(forward_layer_s=1e-3, train_layer_s=3e-3, decode_layer_s=2e-4,
                          forward_pass_s=5e-4, train_pass_s=7e-4, decode_step_s=1e-4)
    graph = pipeline_from_dict(spec)
    paid = EstimatedCosts(graph, cpu_rates=CpuRates(overheads=overheads))
    plain = EstimatedCosts(graph, cpu_rates=CpuRates(overheads=Overheads(0.0, 0.0, 0.0)))

    def extra(node: str) -> float:
        return paid.compute_s(node, [cpu(0)], False) - plain.compute_s(node, [cpu(0)], False)

    # generation: one prefill pass, then 16 decode steps
    assert extra("rollout") == pytest.approx((2 * 1e-3 + 5e-4) + 16 * (2 * 2e-4 + 1e-4))
    assert extra("ref") == pytest.approx(4 * (2 * 1e-3 + 5e-4))
    assert extra("train") == pytest.approx(2 * (2 * 3e-3 + 7e-4))
    # and they are the part of each node's time that sharing the cores does not slow: that
    # and the call's own overhead
    from flowrl.planner.costs import CALL_OVERHEAD_S

    for node in ("rollout", "ref", "train"):
        assert plain.fixed_s(node, [cpu(0)], False) == pytest.approx(CALL_OVERHEAD_S)
        assert paid.fixed_s(node, [cpu(0)], False) == pytest.approx(CALL_OVERHEAD_S + extra(node))
    # a measured time keeps the estimate's share of overheads
    from flowrl.planner.costs import MeasuredCosts

    measured = MeasuredCosts(paid)
    measured.observe("ref", [cpu(0)], 0.1)
    share = paid.fixed_s("ref", [cpu(0)], False) / paid.compute_s("ref", [cpu(0)], False)
    assert measured.fixed_s("ref", [cpu(0)], False) == pytest.approx(0.1 * share)
    assert measured.fixed_s("train", [cpu(0)], False) == paid.fixed_s("train", [cpu(0)], False)
    # checkpointing recomputes each pass's forward: a forward layer's overhead more per layer;
    # mini-batches of 8 rows: each optimizer step's passes of at most 8 rows (here one)
    recomputed = paid.with_work("train", replace(paid.work("train"), checkpointing=True))
    recomputed_plain = plain.with_work("train", replace(plain.work("train"), checkpointing=True))
    assert recomputed.compute_s("train", [cpu(0)], False) - recomputed_plain.compute_s("train", [cpu(0)], False) == (
        pytest.approx(2 * (2 * (3e-3 + 1e-3) + 7e-4)))
    minis = paid.with_work("train", replace(paid.work("train"), num_mini_batches=2, mini_batch_sequences=8))
    minis_plain = plain.with_work("train", replace(plain.work("train"), num_mini_batches=2, mini_batch_sequences=8))
    assert minis.compute_s("train", [cpu(0)], False) - minis_plain.compute_s("train", [cpu(0)], False) == (
        pytest.approx(2 * 1 * (2 * 3e-3 + 7e-4)))
    # a frozen model with adapters: a backward of one forward's work, 2/3 of a layer's
    train = paid.work("train")
    adapted = paid.with_work("train", replace(train, adapter_parameters=8))
    adapted_plain = plain.with_work("train", replace(train, adapter_parameters=8))
    assert adapted.compute_s("train", [cpu(0)], False) - adapted_plain.compute_s("train", [cpu(0)], False) == (
        pytest.approx(2 * (2 * 2e-3 + 7e-4)))


def test_a_cpu_slot_s_overheads_per_token_and_per_row_are_paid_for_every_token_and_row() -> None:
    # 16 rows (4 prompts x 4) of tiny-llama (2 layers), prompts of P and completions of R
    # tokens: the prefill's 4 x P tokens, then R decode steps of 16 rows; the reference's
    # and the update's passes over 16 x (P + R) tokens (in passes of 4 and 8 rows), or, in
    # one pass, each prompt once: 4 x P + 16 x R
    from dataclasses import replace

    from flowrl.planner.cost import CpuRates, Overheads
    from flowrl.planner.costs import EstimatedCosts
    from flowrl.spec.loader import pipeline_from_dict
    from tests.planner.conftest import cpu, grpo

    tiny = "builtin:tiny-llama"
    spec = grpo({"path": tiny, "device_group": "actor_group"}, {"path": tiny, "device_group": "ref_group"},
                {"actor_group": {"type": "cpu"}, "ref_group": {"type": "cpu"}}, batch_size=4, n=4)
    per_token = Overheads(0.0, 0.0, 0.0, forward_token_s=1e-5, train_token_s=3e-5, decode_row_s=2e-5)
    for split in (False, True):
        if split:
            row = EstimatedCosts(pipeline_from_dict(spec)).work("ref")
            spec["nodes"]["ref"]["micro_batch_tokens"] = 4 * (row.prompt_tokens + row.response_tokens)
            spec["nodes"]["train"]["micro_batch_tokens"] = 8 * (row.prompt_tokens + row.response_tokens)
        graph = pipeline_from_dict(spec)
        paid = EstimatedCosts(graph, cpu_rates=CpuRates(overheads=per_token))
        plain = EstimatedCosts(graph, cpu_rates=CpuRates(overheads=Overheads(0.0, 0.0, 0.0)))
        prompt, response = paid.work("ref").prompt_tokens, paid.work("ref").response_tokens
        tokens = 16 * (prompt + response) if split else 4 * prompt + 16 * response
        assert paid.work("ref").shares_prompts(True) is not split

        def extra(node: str) -> float:
            return paid.compute_s(node, [cpu(0)], False) - plain.compute_s(node, [cpu(0)], False)

        assert extra("rollout") == pytest.approx(2 * 4 * prompt * 1e-5 + response * 2 * 16 * 2e-5)
        assert extra("ref") == pytest.approx(2 * tokens * 1e-5)
        assert extra("train") == pytest.approx(2 * tokens * 3e-5)
        for node in ("rollout", "ref", "train"):  # all of it overheads, not slowed by sharing cores
            assert paid.fixed_s(node, [cpu(0)], False) - plain.fixed_s(node, [cpu(0)], False) == (
                pytest.approx(extra(node)))
        # a frozen model with adapters: its backward's FLOPs shrink, not its per-token steps
        train = paid.work("train")
        adapted = paid.with_work("train", replace(train, adapter_parameters=8))
        adapted_plain = plain.with_work("train", replace(train, adapter_parameters=8))
        assert adapted.compute_s("train", [cpu(0)], False) - adapted_plain.compute_s("train", [cpu(0)], False) == (
            pytest.approx(2 * tokens * 3e-5))
    # checkpointing: every row padded (recomputed passes share no prompt), a forward's
    # per-token overhead more per layer
    recomputed = paid.with_work("train", replace(paid.work("train"), checkpointing=True, micro_batch_tokens=None))
    recomputed_plain = plain.with_work("train", replace(plain.work("train"), checkpointing=True,
                                                        micro_batch_tokens=None))
    assert not recomputed.work("train").shares_prompts(True)
    assert recomputed.compute_s("train", [cpu(0)], False) - recomputed_plain.compute_s("train", [cpu(0)], False) == (
        pytest.approx(2 * 16 * (prompt + response) * (3e-5 + 1e-5)))


def test_an_update_of_several_steps_first_runs_a_no_grad_forward_for_its_old_outputs() -> None:
    # the policy's log-probs before its first step (two epochs, or two mini-batches): one
    # no-grad forward over the batch more, what the reference node costs on the same slot;
    # a critic's values before its first step unless a value node gives them
    from dataclasses import replace

    from flowrl.planner.costs import CALL_OVERHEAD_S, EstimatedCosts
    from flowrl.spec.loader import load_pipeline, pipeline_from_dict
    from tests.planner.conftest import cpu, grpo

    tiny = "builtin:tiny-llama"
    spec = grpo({"path": tiny, "device_group": "actor_group"}, {"path": tiny, "device_group": "ref_group"},
                {"actor_group": {"type": "cpu"}, "ref_group": {"type": "cpu"}}, batch_size=4, n=4)
    one = EstimatedCosts(pipeline_from_dict(spec))
    assert not one.work("train").old_outputs_pass
    step = one.compute_s("train", [cpu(0)], False)
    ref = one.compute_s("ref", [cpu(0)], False) - CALL_OVERHEAD_S  # the same model, same rows, no grad
    for setting in ({"ppo_epochs": 2}, {"mini_batch_size": 8}):
        several = EstimatedCosts(pipeline_from_dict({**spec, "nodes": {
            **spec["nodes"], "train": {**spec["nodes"]["train"], **setting}}}))
        work = several.work("train")
        assert work.old_outputs_pass
        epochs, minis = work.ppo_epochs, work.num_mini_batches
        # the steps themselves: per epoch as before, plus each further mini-batch's optimizer
        # step and pass overheads; the old log-probs: exactly one reference-like forward
        plain = several.with_work("train", replace(work, old_outputs_pass=False)).compute_s("train", [cpu(0)], False)
        assert several.compute_s("train", [cpu(0)], False) - plain == pytest.approx(ref)
        assert epochs * minis == 2 and plain > step
    ppo = Path(__file__).resolve().parents[2] / "pipelines"
    assert EstimatedCosts(load_pipeline(ppo / "ppo.yaml")).work("train_critic").old_outputs_pass
    assert not EstimatedCosts(load_pipeline(ppo / "ppo_tiny.yaml")).work("train_critic").old_outputs_pass


def test_the_probe_s_overheads_come_from_the_differences_between_its_timings() -> None:
    # (forward, forward and backward, decode step) seconds of the 1- and 3-layer models at
    # 4 and 32 rows (passes of 16 tokens a row): a layer costs a + b per token (or row)
    from flowrl.planner.overhead_probe import overheads_from

    def seconds(layers: int, rows: int) -> tuple[float, float, float]:
        tokens = 16 * rows
        return (1e-3 + layers * (2e-4 + tokens * 1e-6), 3e-3 + layers * (6e-4 + tokens * 4e-6),
                5e-4 + layers * (1e-4 + rows * 2e-6))

    overheads = overheads_from({(layers, rows): seconds(layers, rows) for layers in (1, 3) for rows in (4, 32)})
    assert overheads.forward_layer_s == pytest.approx(2e-4) and overheads.forward_token_s == pytest.approx(1e-6)
    assert overheads.train_layer_s == pytest.approx(6e-4) and overheads.train_token_s == pytest.approx(4e-6)
    assert overheads.decode_layer_s == pytest.approx(1e-4) and overheads.decode_row_s == pytest.approx(2e-6)
    assert (overheads.forward_pass_s, overheads.train_pass_s, overheads.decode_step_s) == pytest.approx(
        (1e-3, 3e-3, 5e-4))


def test_the_overhead_probe_measures_layers_and_passes_and_leaves_the_process_as_it_was() -> None:
    import torch

    from flowrl.planner.overhead_probe import measure_cpu_overheads

    threads, state = torch.get_num_threads(), torch.random.get_rng_state()
    measure_cpu_overheads.cache_clear()
    overheads = measure_cpu_overheads(repeats=3)
    # three layers take longer than one in every kind of call; a backward more than a forward
    assert 0 < overheads.decode_layer_s and 0 < overheads.forward_layer_s < overheads.train_layer_s
    assert min(overheads.forward_pass_s, overheads.train_pass_s, overheads.decode_step_s) >= 0
    # more rows cost more: a pass's tokens and a step's rows each add a share of a layer
    assert overheads.forward_token_s > 0 and overheads.train_token_s > 0 and overheads.decode_row_s > 0
    assert torch.get_num_threads() == threads
    assert torch.equal(torch.random.get_rng_state(), state)


def test_a_failing_overhead_probe_leaves_the_defaults_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    import flowrl.planner.overhead_probe as probe
    from flowrl.planner.cost import CPU_OVERHEADS, Overheads

    def broken(repeats: int = 5) -> Overheads:
        raise ImportError("no Llama in this transformers")

    monkeypatch.setattr(probe, "measure_cpu_overheads", broken)
    with pytest.warns(RuntimeWarning, match="CPU overhead probe failed .*no Llama"):
        assert probe.cpu_overheads_or_defaults() == CPU_OVERHEADS
    # overheads measured elsewhere (a run's CPU worker) are taken as they are: no probe here
    given = Overheads(forward_layer_s=1e-3, train_layer_s=3e-3, decode_layer_s=2e-4)
    assert measure_cpu_rates(matrix_size=32, repeats=1, overheads=given).overheads == given
