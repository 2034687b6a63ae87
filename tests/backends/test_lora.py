"""LoRA adapters through peft: what trains, the scale, merged weights, the adapter directory,
and the static decoder generating from merged copies that follow the adapters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from flowrl.backends.generation import generate_tokens
from flowrl.backends.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_tensors,
    add_adapters,
    has_adapters,
    is_adapted_layer,
    merged_weight,
    merged_weights,
    read_adapter,
    save_adapter,
)
from flowrl.backends.static_decode import StaticDecoder, decoder_for
from flowrl.errors import ModelLoadError
from flowrl.spec.schema import LoraSpec
from tests.tiny_models import model_state, tiny_policy

IDS = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]])
PAD_ID = 0
VOCAB_SIZE = 40
NO_EOS = VOCAB_SIZE + 5


def adapted(seed: int = 0, rank: int = 4, alpha: int = 8, targets: str | list[str] = "all-linear") -> LlamaForCausalLM:
    module = tiny_policy(seed)
    add_adapters(module, rank, alpha, targets)
    return module


def perturb(module: torch.nn.Module, seed: int, scale: float) -> None:
    """Random non-zero B matrices, so the adapters change what the model computes."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in adapter_tensors(module).items():
            if ".lora_B." in name:
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * scale)


def logits(module: torch.nn.Module, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return module(input_ids=ids).logits


def decoding_model(kind: str) -> Any:
    """Two layers with a large init, so greedy choices are far from ties (as in
    test_static_decode); qwen2 has q/k/v biases and tied embeddings."""
    shape: dict[str, Any] = dict(vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                                 max_position_embeddings=128, pad_token_id=PAD_ID, initializer_range=0.5)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        model: Any
        if kind == "qwen2":
            model = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True))
        else:
            model = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False))
    return model.eval()


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of lengths 5, 2, 7, 3."""
    generator = torch.Generator().manual_seed(1)
    lengths = [5, 2, 7, 3]
    ids = torch.full((len(lengths), 7), PAD_ID, dtype=torch.long)
    mask = torch.zeros(len(lengths), 7, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, 7 - length:] = torch.randint(3, VOCAB_SIZE, (length,), generator=generator)
        mask[row, 7 - length:] = 1
    return ids, mask


def plain_holding(kind: str, weights: dict[str, torch.Tensor]) -> Any:
    plain = decoding_model(kind)
    plain.load_state_dict(weights)
    return plain


def greedy(generate: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """16 greedy tokens per row from ``generate`` (a decoder's ``generate``, or a function of
    the model like ``generate_tokens`` with the model bound), no row stopping early."""
    out = generate(ids, mask, 16, eos_token_id=NO_EOS, pad_token_id=PAD_ID, greedy=True)
    completion: torch.Tensor = out.completion_ids
    return completion


def test_lora_spec_defaults_alpha_to_twice_the_rank() -> None:
    assert (LoraSpec().rank, LoraSpec().scale_alpha, LoraSpec().target_modules) == (16, 32, "all-linear")
    assert LoraSpec(rank=2).scale_alpha == 4
    assert LoraSpec(rank=2, alpha=8).scale_alpha == 8
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        LoraSpec(rank=0)
    with pytest.raises(ValidationError, match="all-linear"):
        LoraSpec(target_modules="all_linear")  # type: ignore[arg-type]


def test_only_the_adapters_train_and_the_model_starts_unchanged() -> None:
    plain = tiny_policy(0)
    module = adapted(0, rank=4)
    assert has_adapters(module) and not has_adapters(plain)
    trained = [name for name, parameter in module.named_parameters() if parameter.requires_grad]
    assert trained and all(".lora_A." in name or ".lora_B." in name for name in trained)
    assert set(trained) == {name for name, _ in module.named_parameters() if ".lora_" in name}
    # 1 layer of hidden 32 (kv width 32), MLP 64, rank 4: q,k,v,o 4*4*(32+32) = 1024;
    # gate, up 2*4*(32+64) = 768; down 4*(64+32) = 384 -> 2176
    assert sum(p.numel() for p in module.parameters() if p.requires_grad) == 2176
    # B starts at zero: the adapters add exactly nothing
    assert torch.equal(logits(module), logits(plain))


def test_two_copies_get_the_same_adapters_and_the_global_rng_is_left_alone() -> None:
    """Every copy and data-parallel rank starts from the same adapters (the run's seed), and
    adding them draws nothing from the run's own random stream; another seed, other A."""
    first, second, other = tiny_policy(0), tiny_policy(0), tiny_policy(0)
    before = torch.get_rng_state()
    add_adapters(first, 4, 8, "all-linear", seed=3)
    assert torch.equal(torch.get_rng_state(), before)
    torch.rand(100)  # the global stream moves on: unseeded, the next A matrices would differ
    add_adapters(second, 4, 8, "all-linear", seed=3)
    add_adapters(other, 4, 8, "all-linear", seed=4)
    key = "model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert not torch.equal(adapter_tensors(other)[key], adapter_tensors(first)[key])
    ours, theirs = adapter_tensors(first), adapter_tensors(second)
    assert ours.keys() == theirs.keys() and len(ours) == 14  # A and B on 7 linear layers
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name
    a = ours["model.layers.0.self_attn.q_proj.lora_A.default.weight"]
    assert a.abs().sum() > 0  # A is random, B zero
    assert not ours["model.layers.0.self_attn.q_proj.lora_B.default.weight"].any()


@pytest.mark.parametrize(("alpha", "scale"), [(None, 2.0), (8, 4.0)])
def test_the_merged_weight_adds_alpha_over_rank_times_b_a(alpha: int | None, scale: float) -> None:
    spec = LoraSpec(rank=2, alpha=alpha)
    module = adapted(0, rank=spec.rank, alpha=spec.scale_alpha)
    layer = module.model.layers[0].self_attn.q_proj
    assert is_adapted_layer(layer) and not is_adapted_layer(module.lm_head)
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(torch.full((2, 32), 0.5))
        layer.lora_B["default"].weight.copy_(torch.arange(32.0)[:, None].expand(32, 2))
    # (B A)[i, j] = 0.5 * i + 0.5 * i = i: row i of W moves by scale * i
    base = layer.get_base_layer().weight
    expected = base + scale * torch.arange(32.0)[:, None]
    assert torch.equal(merged_weight(layer), expected)
    # the layer computes with that weight (outputs up to a few hundred: fp32 sums in
    # another order differ in the last bits)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(layer(x), x @ expected.T, rtol=1e-5, atol=1e-5)


def test_merged_weights_open_in_the_plain_model_as_the_adapted_model() -> None:
    module = adapted(0)
    perturb(module, seed=1, scale=0.5)
    merged = merged_weights(module)
    plain = tiny_policy(5)  # other weights everywhere: every one must come from merged
    assert merged.keys() == plain.state_dict().keys()
    assert not torch.allclose(logits(plain), logits(module))
    plain.load_state_dict(merged)
    torch.testing.assert_close(logits(plain), logits(module), atol=1e-5, rtol=0)
    # the adapters moved the model: a plain copy of the base computes something else
    assert not torch.allclose(logits(tiny_policy(0)), logits(module), atol=1e-3)


def test_an_adapter_directory_round_trips_and_opens_with_peft(tmp_path: Path) -> None:
    from peft import PeftModel

    module = adapted(0)
    perturb(module, seed=2, scale=0.5)
    save_adapter(module, tmp_path, base_model="builtin:tiny-llama")
    assert (tmp_path / ADAPTER_WEIGHTS).is_file() and (tmp_path / ADAPTER_CONFIG).is_file()
    read = read_adapter(tmp_path)
    ours = adapter_tensors(module)
    assert read.keys() == ours.keys()
    for name, tensor in ours.items():
        assert torch.equal(read[name], tensor), name
    opened = PeftModel.from_pretrained(tiny_policy(0), str(tmp_path))
    assert opened.peft_config["default"].base_model_name_or_path == "builtin:tiny-llama"
    assert torch.equal(logits(opened), logits(module))


def test_a_model_state_of_an_adapted_model_hands_over_its_adapters_alone() -> None:
    """What an update changes, and so what other copies receive, is the adapters."""
    trained = model_state("actor", adapted(0))
    perturb(trained.module, seed=3, scale=0.5)
    weights = trained.weights()
    assert weights.keys() == adapter_tensors(trained.module).keys()
    copy = model_state("actor", adapted(0))
    copy.load_weights(weights)
    assert torch.equal(logits(copy.module), logits(trained.module))


@pytest.mark.parametrize(("targets", "message"), [
    (["lm_head"], "output head"),
    (["embed_tokens"], "input embeddings"),
    # every listed name must match (peft takes a list as long as one matches): a typo is named
    (["no_such_layer"], r"models.model.lora.target_modules: \['no_such_layer'\] match no module of 'model'; its "
                        r"linear layers are named \['down_proj', 'gate_proj', 'k_proj', 'o_proj', "
                        r"'q_proj', 'up_proj', 'v_proj'\], or write all-linear"),
    (["q_proj", "vproj"], r"\['vproj'\] match no module"),
    (["model.norm"], "names LlamaRMSNorm modules of 'model', and adapters go on linear layers"),
    # every problem at once: the typo and the head (the head was told only once the typo was fixed)
    (["q_prj", "lm_head"], r"\['q_prj'\] match no module of 'model'.*; 'lm_head' is the output head"),
])
def test_targets_that_cannot_take_adapters_are_refused(targets: list[str], message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        adapted(0, targets=targets)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_static_decoder_generates_from_the_merged_weights(kind: str) -> None:
    model = decoding_model(kind)
    add_adapters(model, 4, 8, "all-linear")
    perturb(model, seed=4, scale=0.3)
    ids, mask = prompts()
    static = greedy(StaticDecoder(model).generate, ids, mask)
    loop = greedy(lambda *args, **kwargs: generate_tokens(model, *args, **kwargs), ids, mask)
    assert torch.equal(static, loop)
    merged = plain_holding(kind, merged_weights(model))
    assert torch.equal(static, greedy(StaticDecoder(merged).generate, ids, mask))
    # the adapters matter: the base model alone says something else
    assert not torch.equal(static, greedy(StaticDecoder(decoding_model(kind)).generate, ids, mask))


def test_a_change_of_the_adapters_is_seen_by_the_next_generation() -> None:
    """An update changes the adapters in place; the decoder's merged copies follow."""
    model = decoding_model("llama")
    add_adapters(model, 4, 8, "all-linear")
    perturb(model, seed=5, scale=0.3)
    decoder = decoder_for(model)
    assert decoder is not None
    ids, mask = prompts()
    before = greedy(decoder.generate, ids, mask)
    perturb(model, seed=6, scale=0.3)
    assert decoder_for(model) is decoder
    after = greedy(decoder.generate, ids, mask)
    assert not torch.equal(after, before)
    merged = plain_holding("llama", merged_weights(model))
    assert torch.equal(after, greedy(StaticDecoder(merged).generate, ids, mask))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_loaded_policy_with_a_lora_spec_trains_its_adapters_alone(tiny_llama_dir: Path, checkpointing: bool) -> None:
    """ModelState.load adds the spec's adapters (alpha None: 2 * rank, a scale of 2); with
    gradient checkpointing the frozen embeddings must not cut the adapters off the backward."""
    from flowrl.roles.state import ModelState

    state = ModelState.load("actor", str(tiny_llama_dir), dtype="fp32", device="cpu", seed=0, base_dir=None,
                            gradient_checkpointing=checkpointing, lora=LoraSpec(rank=2))
    module: Any = state.module
    layer = module.model.layers[0].mlp.down_proj
    assert has_adapters(state.module) and layer.scaling == {"default": 2.0}
    assert state.changing_tensors().keys() == adapter_tensors(state.module).keys()
    assert state.source == str(tiny_llama_dir)
    state.module.train()
    state.module(input_ids=IDS).logits.float().pow(2).mean().backward()
    # B is zero, so A's gradient is zero too; every B of both layers has a non-zero gradient
    named = dict(state.module.named_parameters())
    b_matrices = [name for name in named if ".lora_B." in name]
    assert len(b_matrices) == 2 * 7
    for name in b_matrices:
        grad = named[name].grad
        assert grad is not None and grad.abs().sum() > 0, name
    assert all(parameter.grad is None for name, parameter in named.items() if ".lora_" not in name)


def test_a_bf16_model_gets_bf16_adapters_stepped_through_fp32_masters(tiny_llama_dir: Path) -> None:
    """The adapters take the model's dtype (their products need no casts); the optimizer
    steps fp32 masters of them, so a step far below bf16's resolution is kept."""
    from flowrl.roles.master_weights import MasterWeightAdamW
    from flowrl.roles.state import ModelState

    state = ModelState.load("actor", str(tiny_llama_dir), dtype="bf16", device="cpu", seed=0, base_dir=None,
                            lora=LoraSpec(rank=2))
    assert {p.dtype for p in state.module.parameters()} == {torch.bfloat16}
    optimizer = state.ensure_optimizer(1e-6, (0.9, 0.999), 0.0)
    assert isinstance(optimizer, MasterWeightAdamW)
    assert len(optimizer.model_params) == 2 * 2 * 7  # A and B of 7 layers in each of 2 decoder layers
    b = dict(state.module.named_parameters())["model.layers.0.self_attn.q_proj.lora_B.default.weight"]
    with torch.no_grad():
        b.fill_(0.1)
    optimizer.sync_masters()
    state.module(input_ids=IDS).logits.float().pow(2).mean().backward()
    optimizer.step()
    # Adam's first step moves each entry with a gradient by lr = 1e-6; bf16's spacing at 0.1
    # is about 5e-4, so the bf16 adapter stays while its fp32 master keeps the step
    index = next(i for i, p in enumerate(optimizer.model_params) if p is b)
    master = optimizer.param_groups[0]["params"][index]  # the masters are what AdamW steps
    assert torch.equal(b.detach(), torch.full_like(b, 0.1))
    assert (master - b.detach().float()).abs().max().item() == pytest.approx(1e-6, rel=2e-2)


def test_the_base_fingerprint_samples_large_tensors_up_to_their_last_element() -> None:
    """More than 2^24 elements (a real model's embedding): positions computed in floats would
    round past the end; the last element is one of the samples."""
    from flowrl.backends.lora import base_fingerprint

    module = torch.nn.Embedding(4097, 4096).to(torch.bfloat16)
    before = base_fingerprint(module)
    with torch.no_grad():
        module.weight[-1, -1] += 1.0
    assert base_fingerprint(module) != before


def test_a_rank_above_every_width_the_adapters_see_is_refused() -> None:
    """hidden 64, MLP 128, 2 KV heads of 16: q/o/gate/up/down see at most 64 directions, k/v 32."""
    from flowrl.backends.lora import rank_problem

    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=128))
    assert rank_problem(model, "all-linear", 64) is None
    assert rank_problem(model, "all-linear", 65, "actor") == (
        "rank 65 is above the smaller side of every layer the adapters of 'actor' go on (the largest is 64): an "
        "adapter of rank r on an m x n layer learns at most min(m, n) directions, so rank 64 trains as much with "
        "fewer parameters; set rank: 64 or less")
    assert rank_problem(model, ["k_proj", "v_proj"], 32) is None
    assert "(the largest is 32)" in (rank_problem(model, ["k_proj", "v_proj"], 33) or "")
