"""A model's checkpoint: weights split at ``max_shard_size``, read back whole, sealed by the manifest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, LlamaForCausalLM

from flowrl.api.outputs import RunFolder
from flowrl.api.recovery import checkpoint_problem
from flowrl.backends.lora import (
    ADAPTER_CONFIG, ADAPTER_DIR, ADAPTER_WEIGHTS, adapter_tensors, add_adapters, merged_weights,
)
from flowrl.backends.weight_files import INDEX_NAME, WEIGHTS_NAME, read_weights, shard_size_bytes
from flowrl.errors import CheckpointError
from flowrl.roles.state import ModelState
from flowrl.runtime.checkpoint import STATE_FILE, load_model_state, save_model_state
from tests.tiny_models import model_state, tiny_llama_config, tiny_policy, tiny_scalar_model


def _trained(state: ModelState) -> ModelState:
    """One optimizer step, so the weights differ from a fresh model's and Adam has state."""
    optimizer = state.ensure_optimizer(1e-2, (0.9, 0.999), 0.0)
    ids = torch.tensor([[5, 6, 7, 8]])
    out = state.module(input_ids=ids)
    loss = (out.logits if hasattr(out, "logits") else out).float().pow(2).mean()
    loss.backward()
    optimizer.step()
    state.num_updates = 1
    state.generator.manual_seed(123)
    return state


def _shards(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("model-*.safetensors"))


def test_a_policy_above_the_shard_size_is_written_in_shards_and_resumed_whole(tmp_path: Path) -> None:
    saved = _trained(model_state("actor", tiny_policy(seed=0)))
    directory = tmp_path / "step-1" / "actor"
    save_model_state(saved, directory, with_state=True, max_shard_size="20KB")

    shards = _shards(directory)
    assert len(shards) > 1 and shards[-1] == f"model-{len(shards):05d}-of-{len(shards):05d}.safetensors"
    assert (directory / INDEX_NAME).is_file() and not (directory / WEIGHTS_NAME).exists()
    # transformers opens the sharded directory as it is
    opened = AutoModelForCausalLM.from_pretrained(directory)
    for key, value in saved.module.state_dict().items():
        assert torch.equal(opened.state_dict()[key], value), key

    resumed = model_state("actor", tiny_policy(seed=1), seed=1)
    load_model_state(resumed, directory)
    for key, value in saved.module.state_dict().items():
        assert torch.equal(resumed.module.state_dict()[key], value), key
    assert resumed.num_updates == 1 and torch.equal(resumed.generator.get_state(), saved.generator.get_state())
    assert resumed.optimizer is not None
    assert str(resumed.optimizer.state_dict()["state"]) == str(saved.optimizer.state_dict()["state"])  # type: ignore[union-attr]


def test_a_critic_checkpoint_is_sharded_too_and_opens_as_a_token_classifier(tmp_path: Path) -> None:
    saved = _trained(model_state("critic", tiny_scalar_model(seed=0)))
    directory = tmp_path / "critic"
    save_model_state(saved, directory, with_state=False, max_shard_size="20KB")
    assert len(_shards(directory)) > 1 and not (directory / STATE_FILE).exists()
    resumed = model_state("critic", tiny_scalar_model(seed=1))
    load_model_state(resumed, directory, parts=("weights",))
    for key, value in saved.module.state_dict().items():
        assert torch.equal(resumed.module.state_dict()[key], value), key
    opened = AutoModelForTokenClassification.from_pretrained(directory)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(opened(input_ids=ids).logits[..., 0], saved.module(input_ids=ids))


def test_a_small_model_stays_one_file(tmp_path: Path) -> None:
    save_model_state(model_state("actor", tiny_policy()), tmp_path, with_state=False, max_shard_size="5GB")
    assert (tmp_path / WEIGHTS_NAME).is_file() and not (tmp_path / INDEX_NAME).exists() and not _shards(tmp_path)


def test_the_manifest_covers_every_shard_and_the_index(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path)
    for step in (2, 4):
        staging = folder.checkpoint_staging(step)
        save_model_state(model_state("actor", tiny_policy()), staging / "actor", True, max_shard_size="20KB")
        assert checkpoint_problem(folder.commit_checkpoint(staging, step, {}, keep=2)) is None
    second = _shards(folder.checkpoints / "step-2" / "actor")[1]
    (folder.checkpoints / "step-2" / "actor" / second).unlink()
    assert checkpoint_problem(folder.checkpoints / "step-2") == f"missing files: actor/{second}"
    (folder.checkpoints / "step-4" / "actor" / INDEX_NAME).write_text("{}")
    assert checkpoint_problem(folder.checkpoints / "step-4") == (
        f"corrupt files (checksum differs): actor/{INDEX_NAME}"
    )


def test_a_checkpoint_without_weights_or_with_a_lost_shard_is_a_checkpoint_error(tmp_path: Path) -> None:
    state = model_state("actor", tiny_policy())
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="has no weights: expected model.safetensors or model.safetensors.index.json"):
        load_model_state(state, tmp_path / "empty")
    save_model_state(state, tmp_path / "cut", with_state=False, max_shard_size="20KB")
    (tmp_path / "cut" / _shards(tmp_path / "cut")[0]).unlink()
    with pytest.raises(CheckpointError, match="cannot read the weights of 'actor'"):
        load_model_state(state, tmp_path / "cut")


def _adapted(seed: int = 0) -> ModelState:
    """The tiny policy with rank-4 adapters on every linear layer of its decoder layer."""
    module = tiny_policy(seed=0)  # the same frozen base in every copy, as loading one path gives
    add_adapters(module, 4, 8, "all-linear")
    state = model_state("actor", module, seed=seed)
    state.source = "builtin:tiny-llama"
    return state


def test_an_adapted_policy_checkpoints_its_adapters_alone_and_its_final_model_merged(tmp_path: Path) -> None:
    saved = _trained(_adapted())
    assert saved.optimizer is not None
    adapters = adapter_tensors(saved.module)
    # AdamW holds the adapters alone: the model's own weights are frozen
    optimized = {id(parameter) for group in saved.optimizer.param_groups for parameter in group["params"]}
    assert optimized == {id(parameter) for name, parameter in saved.module.named_parameters() if ".lora_" in name}
    # the step moved the adapters (B was zero), so merged weights are not the base's
    merged = merged_weights(saved.module)
    base = tiny_policy(seed=0).state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[name], base[name])

    directory = tmp_path / "step-1" / "actor"
    save_model_state(saved, directory, with_state=True, max_shard_size="20KB")
    # a checkpoint: the adapters and the optimizer's state, no model weights (they are frozen)
    assert not _shards(directory) and not (directory / WEIGHTS_NAME).exists()
    assert (directory / ADAPTER_DIR / ADAPTER_WEIGHTS).is_file() and (directory / STATE_FILE).is_file()
    config = json.loads((directory / ADAPTER_DIR / ADAPTER_CONFIG).read_text())
    assert (config["base_model_name_or_path"], config["r"], config["lora_alpha"]) == ("builtin:tiny-llama", 4, 8)
    # the final model: a plain model directory of the merged weights, in shards, and the adapters
    final = tmp_path / "final"
    save_model_state(saved, final, with_state=False, max_shard_size="20KB")
    assert len(_shards(final)) > 1 and (final / ADAPTER_DIR / ADAPTER_WEIGHTS).is_file()
    opened = AutoModelForCausalLM.from_pretrained(final)
    assert opened.state_dict().keys() == merged.keys()
    for key, value in merged.items():
        assert torch.equal(opened.state_dict()[key], value), key
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(opened(input_ids=ids).logits, saved.module(input_ids=ids).logits,
                                   atol=1e-5, rtol=0)

    resumed = _adapted(seed=1)
    load_model_state(resumed, directory)
    for key, value in adapters.items():
        assert torch.equal(adapter_tensors(resumed.module)[key], value), key
    assert resumed.num_updates == 1 and torch.equal(resumed.generator.get_state(), saved.generator.get_state())
    assert resumed.optimizer is not None
    assert str(resumed.optimizer.state_dict()["state"]) == str(saved.optimizer.state_dict()["state"])
    assert len(resumed.optimizer.state_dict()["state"]) == len(adapters)


def test_a_checkpoint_without_adapters_cannot_resume_an_adapted_model(tmp_path: Path) -> None:
    """Its weights are whole models' weights, and the adapters would silently restart at zero."""
    save_model_state(_trained(model_state("actor", tiny_policy())), tmp_path / "actor", True, max_shard_size="5GB")
    with pytest.raises(CheckpointError, match="has no adapter/adapter_model.safetensors"):
        load_model_state(_adapted(), tmp_path / "actor")


def test_adapters_resume_only_beside_the_frozen_weights_they_were_trained_on(tmp_path: Path) -> None:
    """The checkpoint holds the adapters; the frozen weights come from the model's path again.
    The same weights in another dtype are the same base; trained or replaced ones are not."""
    save_model_state(_trained(_adapted()), tmp_path / "actor", True, max_shard_size="5GB")
    same_in_bf16 = _adapted()
    same_in_bf16.module.to(torch.bfloat16)
    load_model_state(same_in_bf16, tmp_path / "actor")  # no error
    changed = _adapted()
    with torch.no_grad():
        for name, parameter in changed.module.named_parameters():
            if ".lora_" not in name:
                parameter.add_(0.01 * torch.randn_like(parameter))  # the base trained a little more
    with pytest.raises(CheckpointError, match=r"the frozen weights of models.actor \(from builtin:tiny-llama\) are "
                                              r"not those the adapters in .*actor/adapter were trained on"):
        load_model_state(changed, tmp_path / "actor")
    load_model_state(changed, tmp_path / "actor", parts=("generator",))  # no weights taken: nothing to compare


def test_a_checkpoint_of_other_adapters_or_of_adapters_into_a_plain_model_is_a_checkpoint_error(tmp_path: Path) -> None:
    """A resume forced past a changed lora setting: what differs and what to do, not an
    optimizer's or a tensor's error."""
    save_model_state(_trained(_adapted()), tmp_path / "actor", True, max_shard_size="5GB")
    other = model_state("actor", tiny_policy())
    add_adapters(other.module, rank=8, alpha=16, target_modules="all-linear")
    with pytest.raises(CheckpointError, match=r"other settings than models.actor.lora now \(rank: 4 -> 8; alpha: 8 "
                                              r"-> 16\)"):
        load_model_state(other, tmp_path / "actor")
    scaled = model_state("actor", tiny_policy())
    add_adapters(scaled.module, rank=4, alpha=16, target_modules="all-linear")  # saved: alpha 8
    with pytest.raises(CheckpointError, match=r"other settings than models.actor.lora now \(alpha: 8 -> 16\)"):
        load_model_state(scaled, tmp_path / "actor")
    fewer = model_state("actor", tiny_policy())
    add_adapters(fewer.module, rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
    with pytest.raises(CheckpointError, match=r"\(target_modules: \['down_proj', 'gate_proj', 'k_proj', 'o_proj', "
                                              r"'q_proj', 'up_proj', 'v_proj'\] -> \['q_proj', 'v_proj'\]\)"):
        load_model_state(fewer, tmp_path / "actor")
    with pytest.raises(CheckpointError, match="holds adapters .lora., and models.actor has none now"):
        load_model_state(model_state("actor", tiny_policy()), tmp_path / "actor")


def test_shard_sizes_in_decimal_and_binary_units() -> None:
    assert shard_size_bytes("5GB") == 5 * 10**9
    assert shard_size_bytes("500MB") == 500 * 10**6
    assert shard_size_bytes("2GiB") == 2 * 2**30
    assert shard_size_bytes("64KiB") == 65536
    with pytest.raises(ValueError, match="like 500MB or 2GiB"):
        shard_size_bytes("5 gigabytes")


def test_read_weights_takes_only_the_named_tensors(tmp_path: Path) -> None:
    module = tiny_policy()
    module.save_pretrained(tmp_path, max_shard_size=shard_size_bytes("20KB"))
    name = "model.norm.weight"
    assert read_weights(tmp_path, [name]).keys() == {name}
    with pytest.raises(KeyError, match="no.such"):
        read_weights(tmp_path, ["no.such"])


def _policy(seed: int = 0, **changes: object) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = tiny_llama_config()
    for key, value in changes.items():
        setattr(config, key, value)
    return LlamaForCausalLM(config)


def test_a_checkpoint_of_another_model_shape_is_a_checkpoint_error_naming_the_weights(tmp_path: Path) -> None:
    """``flowrl resume --force`` with the model path changed to a model of another width
    failed in a tensor copy with a traceback."""
    directory = tmp_path / "actor"
    save_model_state(_trained(model_state("actor", _policy())), directory, with_state=True, max_shard_size="5GB")
    with pytest.raises(CheckpointError, match=r"in the checkpoint of 'actor' in .* do not match models.actor now: "
                                              r"other shapes: lm_head.weight \[\d+, 32\] against \[\d+, 16\] now, .* and 9 more"):
        load_model_state(model_state("actor", _policy(hidden_size=16, intermediate_size=32)), directory)


def test_tied_and_untied_checkpoints_resume_only_into_their_own_kind(tmp_path: Path) -> None:
    """A tied model's file holds the embedding once (the head is the same tensor): it resumes
    into a tied model, and is refused by an untied one (whose head it lacks; its optimizer
    state, of one tensor fewer, failed in torch's loading with a traceback)."""
    tied = tmp_path / "tied"
    saved = _trained(model_state("actor", _policy(tie_word_embeddings=True)))
    save_model_state(saved, tied, with_state=True, max_shard_size="5GB")
    resumed = model_state("actor", _policy(seed=1, tie_word_embeddings=True))
    load_model_state(resumed, tied)
    assert torch.equal(resumed.module.lm_head.weight, saved.module.lm_head.weight)
    with pytest.raises(CheckpointError, match="weights the checkpoint lacks: lm_head.weight"):
        load_model_state(model_state("actor", _policy(tie_word_embeddings=False)), tied)
    untied = model_state("actor", _policy(tie_word_embeddings=False))
    with pytest.raises(CheckpointError, match="the optimizer state of 'actor' is for 11 trained tensors, and "
                                              "models.actor trains 12"):
        untied.restore({"optimizer": saved.optimizer.state_dict()})  # type: ignore[union-attr]
