"""Builtin models: deterministic bytes, loadable directories, atomic cache writes."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flowrl.backends import builtin
from flowrl.backends.builtin import BUILTIN_MODELS, builtin_model_dir
from flowrl.errors import ModelLoadError


def weights_sha256(directory: Path) -> str:
    return hashlib.sha256((directory / "model.safetensors").read_bytes()).hexdigest()


def test_shapes_of_the_builtin_models() -> None:
    tiny, small = BUILTIN_MODELS["tiny-llama"], BUILTIN_MODELS["small-llama"]
    assert (tiny.hidden_size, tiny.num_layers, tiny.num_heads, tiny.intermediate_size) == (
        128, 2, 4, 512,
    )
    assert (small.hidden_size, small.num_layers, small.num_heads, small.intermediate_size) == (
        256, 4, 4, 1024,
    )


def test_building_twice_gives_the_same_bytes(tiny_llama_dir: Path, tmp_path: Path) -> None:
    again = builtin_model_dir("tiny-llama", tmp_path)
    assert again != tiny_llama_dir
    assert weights_sha256(again) == weights_sha256(tiny_llama_dir)


def test_directory_layout_and_reuse(tiny_llama_dir: Path) -> None:
    assert tiny_llama_dir.name == "tiny-llama-v1"
    assert tiny_llama_dir.parent.name == "models"
    before = (tiny_llama_dir / "model.safetensors").stat().st_mtime_ns
    assert builtin_model_dir("builtin:tiny-llama", tiny_llama_dir.parent.parent) == tiny_llama_dir
    assert (tiny_llama_dir / "model.safetensors").stat().st_mtime_ns == before
    # Only the finished directory is left; no temporary ".tiny-llama-v1-*" siblings.
    assert [path.name for path in tiny_llama_dir.parent.iterdir()] == ["tiny-llama-v1"]


def test_loadable_by_transformers(tiny_llama_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert model.config.vocab_size == len(tokenizer) == 83
    assert model.config.hidden_size == 128 and model.config.num_hidden_layers == 2
    assert not model.config.tie_word_embeddings
    ids = torch.tensor([tokenizer("abc=")["input_ids"]])
    assert model(ids).logits.shape == (1, 4, 83)


def test_cache_root_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                     tiny_llama_dir: Path) -> None:
    # Seed the env cache with the session's copy so nothing is rebuilt.
    shutil.copytree(tiny_llama_dir, tmp_path / "models" / "tiny-llama-v1")
    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path))
    assert builtin_model_dir("tiny-llama") == tmp_path / "models" / "tiny-llama-v1"


def test_losing_the_race_uses_the_winners_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_llama_dir: Path
) -> None:
    target = tmp_path / "models" / "tiny-llama-v1"
    real_write = builtin.write_builtin

    def write_while_another_process_wins(shape: builtin.BuiltinModel, directory: Path) -> None:
        real_write(shape, directory)
        shutil.copytree(tiny_llama_dir, target)  # the other builder renames first

    monkeypatch.setattr(builtin, "write_builtin", write_while_another_process_wins)
    assert builtin_model_dir("tiny-llama", tmp_path) == target
    assert weights_sha256(target) == weights_sha256(tiny_llama_dir)
    assert [path.name for path in target.parent.iterdir()] == ["tiny-llama-v1"]


def test_directory_without_config_is_reported(tmp_path: Path) -> None:
    (tmp_path / "models" / "tiny-llama-v1").mkdir(parents=True)
    with pytest.raises(ModelLoadError, match="holds no config.json"):
        builtin_model_dir("tiny-llama", tmp_path)


def test_unknown_name_suggests_the_closest(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as raised:
        builtin_model_dir("tiny-lama", tmp_path)
    message = str(raised.value)
    assert "did you mean 'tiny-llama'?" in message
    assert "small-llama, tiny-llama" in message
    assert not (tmp_path / "models").exists()
