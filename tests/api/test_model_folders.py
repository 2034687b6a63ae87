"""A model folder of one's own that cannot be loaded as it is: a config.json that is not JSON,
a weights file cut short, weights of another shape than config.json's. Each is refused by
validation at the model's path, and the worker's own load says the same kind of thing, never
a traceback. A tokenizer whose class adds a pad token past the embedding is accepted, as the
run pads with eos then."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from flowrl.api.checks import model_problems
from flowrl.backends.hf import load_causal_lm
from flowrl.errors import ModelLoadError, PlacementError
from flowrl.planner.cost import resolve_shape
from flowrl.spec.loader import pipeline_from_dict

WORDS = "the a cat dog sat on mat one two three plus minus equals answer is what".split()


def _tokenizer(pad: bool) -> Any:
    """A byte-level BPE of 100 ids trained on a few hundred lines: <pad> 0 (when asked), <eos>, <unk>."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(8)) + f" {rng.randint(0, 99)}" for _ in range(200)]
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<eos>", "<unk>"] if pad else ["<eos>", "<unk>"]
    backend.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=100, special_tokens=specials,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>",
                                   **({"pad_token": "<pad>"} if pad else {}))


def _qwen2(folder: Path, pad: bool = True) -> Path:
    """A Qwen2 of hidden 32 and one layer, its tokenizer beside it."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = _tokenizer(pad)
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                         tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


def _pipeline(actor: Path, reference: Path) -> Any:
    return pipeline_from_dict({
        "name": "own",
        "models": {"actor": {"path": str(actor)}, "reference": {"path": str(reference)}},
        "nodes": {
            "rollout": {"role": "generate", "model": "actor", "inputs": ["prompts"], "n": 2, "max_new_tokens": 8},
            "reward": {"role": "score", "fn": "digits", "inputs": ["rollout"]},
            "ref": {"role": "reference_logprob", "model": "reference", "inputs": ["rollout"]},
            "adv": {"role": "advantage", "inputs": ["reward"]},
            "train": {"role": "update", "model": "actor", "inputs": ["rollout", "adv", "ref"], "kl_coef": 0.1},
        },
        "data": {"source": "builtin:digits"},
    })


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _qwen2(tmp_path_factory.mktemp("good"))


def _copy(good: Path, folder: Path) -> Path:
    import shutil

    shutil.copytree(good, folder)
    return folder


def test_a_folder_of_ones_own_is_valid(good: Path) -> None:
    assert model_problems(_pipeline(good, good), None) == []


def test_a_config_that_is_not_json_is_refused_by_validation_and_by_the_planner(good: Path, tmp_path: Path) -> None:
    broken = _copy(good, tmp_path / "broken")
    (broken / "config.json").write_text("{not json")
    [(field, message)] = model_problems(_pipeline(good, broken), None)
    assert field == "models.reference.path"
    assert message.startswith(f"{broken / 'config.json'} is not valid JSON (Expecting property name")
    with pytest.raises(PlacementError, match=rf"cannot size model '{broken}' for planning: .*config.json is not "
                                             r"valid JSON"):
        resolve_shape(str(broken))


def test_a_weights_file_cut_short_is_refused_by_validation_and_by_the_load(good: Path, tmp_path: Path) -> None:
    cut = _copy(good, tmp_path / "cut")
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    [(field, message)] = model_problems(_pipeline(cut, good), None)
    assert field == "models.actor.path"
    assert message.startswith(f"{weights} is damaged (") and message.endswith("copy or download it again")
    with pytest.raises(ModelLoadError, match=rf"cannot load model '{cut}' from {cut}: .*incomplete metadata"):
        load_causal_lm(str(cut))


def test_weights_of_another_shape_than_the_config_are_refused_by_validation_and_by_the_load(
        good: Path, tmp_path: Path) -> None:
    other = _copy(good, tmp_path / "other")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "hidden_size": 16}))
    [(field, message)] = model_problems(_pipeline(good, other), None)
    assert field == "models.reference.path"
    rows = config["vocab_size"]
    assert message == (f"{other / 'model.safetensors'} holds model.embed_tokens.weight of shape [{rows}, 32], but "
                       f"config.json makes it [{rows}, 16]: the weights were saved from a model of another "
                       "configuration; pass the config.json saved with them")
    with pytest.raises(ModelLoadError, match=rf"cannot load model '{other}' from {other}: its weights are not of the "
                                             r"shapes its config.json gives"):
        load_causal_lm(str(other))


def test_a_tokenizer_whose_class_adds_a_pad_past_the_embedding_is_accepted(tmp_path: Path) -> None:
    from flowrl.backends.policy_tokenizer import load_tokenizer

    folder = _qwen2(tmp_path / "nopad", pad=False)
    rows = json.loads((folder / "config.json").read_text())["vocab_size"]
    # transformers reads the folder with Qwen2's tokenizer class, which adds its own pad token
    # after the ids the model has rows for
    tokenizer = load_tokenizer(str(folder))
    assert (len(tokenizer), tokenizer.pad_token_id) == (rows + 1, rows)
    assert model_problems(_pipeline(folder, folder), None) == []
    # the run pads with eos instead (hf.set_padding)
    _, loaded = load_causal_lm(str(folder))
    assert loaded.pad_token_id == loaded.eos_token_id


def test_a_mistyped_folder_name_read_as_a_hub_name_asks_about_the_folder_beside_it(
        good: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # 'goodd' has no slash and no folder of that name: a hub name, which cannot be fetched here
    [(field, message)] = model_problems(_pipeline(good, Path(good.name + "d")), good.parent)
    assert field == "models.reference.path"
    assert message.startswith(f"model '{good.name}d' is not a local directory (did you mean the model folder "
                              f"'{good.name}' here?) nor in the local Hugging Face cache")


def test_of_the_runtime_errors_of_a_load_only_a_shape_mismatch_is_the_users() -> None:
    """A RuntimeError out of memory or from the card is the machine's: it stays a fault of the
    worker (retried, the worker checked), never a message that blames the model folder."""
    from flowrl.backends.hf import user_load_failure

    assert user_load_failure(RuntimeError("Error(s) in loading state_dict: size mismatch for lm_head.weight"))
    assert user_load_failure(OSError("no file named config.json"))
    assert not user_load_failure(RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't "
                                              "allocate memory: you tried to allocate 8589934592 bytes"))
    assert not user_load_failure(RuntimeError("CUDA error: an illegal memory access was encountered"))


def test_the_weights_check_takes_shards_a_bare_backbone_and_a_value_head(tmp_path: Path) -> None:
    """Layouts that load: weights in shards with their index, a backbone saved without the
    causal LM's prefix, a token-classification (value) head beside the backbone."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForTokenClassification, Qwen2Model

    from flowrl.api.checks import _weights_problem

    tokenizer = _tokenizer(pad=True)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False, num_labels=1)
    torch.manual_seed(0)
    for name, model, shard in (("sharded", Qwen2ForCausalLM(config), "20KB"), ("bare", Qwen2Model(config), "5GB"),
                               ("value", Qwen2ForTokenClassification(config), "5GB")):
        folder = tmp_path / name
        model.save_pretrained(folder, max_shard_size=shard)
        tokenizer.save_pretrained(folder)
        assert _weights_problem(folder, str(folder), None, False) is None, name
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    # a shard the index names that is gone
    next((tmp_path / "sharded").glob("model-00002-of-*.safetensors")).unlink()
    problem = _weights_problem(tmp_path / "sharded", str(tmp_path / "sharded"), None, False)
    assert problem is not None and "model-00002-of-" in problem and "is missing (model.safetensors.index.json names it)" in problem
