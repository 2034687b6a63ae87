"""Loading models: builtin names, local directories, hub names without network."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from flowrl.backends import hf
from flowrl.backends.hf import load_causal_lm, resolve_model_path
from flowrl.errors import ModelLoadError

MISSING_HUB_NAME = "flowrl-tests/no-such-model"


def test_builtin_name_resolves_to_the_cache(monkeypatch: pytest.MonkeyPatch,
                                            tiny_llama_dir: Path) -> None:
    monkeypatch.setenv("FLOWRL_CACHE", str(tiny_llama_dir.parent.parent))
    assert resolve_model_path("builtin:tiny-llama", None) == tiny_llama_dir


def test_relative_directory_is_found_next_to_the_pipeline(tmp_path: Path,
                                                          tiny_llama_dir: Path) -> None:
    shutil.copytree(tiny_llama_dir, tmp_path / "weights" / "actor")
    assert resolve_model_path("weights/actor", tmp_path) == tmp_path / "weights" / "actor"
    model, tokenizer = load_causal_lm("weights/actor", "fp32", base_dir=tmp_path)
    assert model.dtype == torch.float32
    assert tokenizer.pad_token_id == 0 and tokenizer.padding_side == "left"


def test_dtype_is_applied(tiny_llama_dir: Path) -> None:
    model, _ = load_causal_lm(str(tiny_llama_dir), "bf16")
    assert model.dtype == torch.bfloat16
    assert model.device.type == "cpu"


def test_missing_pad_token_falls_back_to_eos(tmp_path: Path, tiny_llama_dir: Path) -> None:
    from transformers import AutoTokenizer

    directory = tmp_path / "no-pad"
    shutil.copytree(tiny_llama_dir, directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(directory)
    _, loaded = load_causal_lm(str(directory), "fp32")
    assert loaded.pad_token == "<eos>" and loaded.pad_token_id == 2


def test_missing_local_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="model directory './nowhere' not found"):
        load_causal_lm("./nowhere", "fp32", base_dir=tmp_path)


def test_directory_without_config(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_causal_lm(str(tmp_path / "empty"), "fp32")


def test_file_instead_of_directory(tmp_path: Path) -> None:
    (tmp_path / "model.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="is a file"):
        load_causal_lm("model.bin", "fp32", base_dir=tmp_path)


def test_hub_name_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def no_probe(timeout_s: float) -> bool:
        raise AssertionError("offline mode must not touch the network")

    monkeypatch.setattr(hf, "hub_reachable", no_probe)
    with pytest.raises(ModelLoadError) as raised:
        load_causal_lm(MISSING_HUB_NAME, "fp32")
    assert str(raised.value) == (
        f"model '{MISSING_HUB_NAME}' is not a local directory and cannot be downloaded "
        "(no network): download it elsewhere and pass its directory, or use builtin:tiny-llama"
    )


def test_hub_name_without_network(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(hf.hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf, "hub_reachable", lambda timeout_s: False)
    with pytest.raises(ModelLoadError, match="cannot be downloaded \\(no network\\)"):
        load_causal_lm(MISSING_HUB_NAME, "fp32")


def test_offline_flag_is_read_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf.hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "yes")
    assert hf.hub_offline()
    monkeypatch.delenv("TRANSFORMERS_OFFLINE")
    assert not hf.hub_offline()


def test_unknown_dtype(tiny_llama_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="unknown dtype 'fp8'"):
        load_causal_lm(str(tiny_llama_dir), "fp8")  # type: ignore[arg-type]
