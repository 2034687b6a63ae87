"""Loading models: builtin names, local directories, hub names without network, revisions and
models that bring their own code."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import dynamic_module_utils

from flowrl.backends import hf, hub, value_model
from flowrl.backends.hf import HubOptions, load_causal_lm, resolve_model_path
from flowrl.backends.models import resolve_model_path as resolve_any_model_path
from flowrl.errors import FlowrlError, ModelLoadError, RemoteCodeNotTrusted
from flowrl.roles.state import ModelState
from flowrl.runtime.host import RoleHost
from flowrl.spec.schema import ModelSpec

MISSING_HUB_NAME = "flowrl-tests/no-such-model"


def test_builtin_name_resolves_to_the_cache(monkeypatch: pytest.MonkeyPatch,
                                            tiny_llama_dir: Path) -> None:
    monkeypatch.setenv("FLOWRL_CACHE", str(tiny_llama_dir.parent.parent))
    assert resolve_any_model_path("builtin:tiny-llama", None) == tiny_llama_dir
    # the loaders themselves take folders and hub names: builtin names go through backends.models
    with pytest.raises(ModelLoadError, match="builtin model: load it through flowrl.backends.models"):
        resolve_model_path("builtin:tiny-llama", None)


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


def test_a_pad_token_outside_the_embedding_gives_way_to_eos_and_generation_runs(
        tmp_path: Path, tiny_llama_dir: Path) -> None:
    """A tokenizer that adds a pad token its model has no row for (as transformers' Qwen2
    tokenizer class does for a tokenizer saved without one): padded prompts and finished rows
    would look the pad id up in the embedding."""
    from transformers import AutoTokenizer

    from flowrl.data import PromptExample
    from flowrl.roles.generate import run_generate
    from flowrl.spec.schema import GenerateNode

    directory = tmp_path / "extra-pad"
    shutil.copytree(tiny_llama_dir, directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    rows = int(json.loads((directory / "config.json").read_text())["vocab_size"])
    tokenizer.add_special_tokens({"pad_token": "<extra-pad>"})
    assert tokenizer.pad_token_id == rows  # one past the embedding's last row
    tokenizer.save_pretrained(directory)
    model, loaded = load_causal_lm(str(directory), "fp32")
    assert loaded.pad_token == "<eos>" and loaded.pad_token_id == 2
    state = ModelState("actor", model, loaded, torch.device("cpu"), torch.Generator().manual_seed(0))
    node = GenerateNode(model="actor", inputs=["prompts"], n=2, max_new_tokens=6)
    rollout = run_generate(state, [PromptExample("a=", "a"), PromptExample("bcdef=", "b")], node).value
    assert rollout.prompt_ids[0, 0] == 2 and rollout.prompt_mask[0, 0] == 0  # padded with eos
    # the added token itself, in a prompt, has no row in the embedding
    with pytest.raises(FlowrlError, match=r"a prompt holds token id \d+ \('<extra-pad>'\), but the embedding of "
                                          r"model 'actor' has \d+ rows"):
        run_generate(state, [PromptExample("a<extra-pad>=", "a")], node)


def test_an_eos_outside_the_embedding_is_another_model_s_tokenizer(tmp_path: Path, tiny_llama_dir: Path) -> None:
    from transformers import AutoTokenizer

    directory = tmp_path / "foreign-eos"
    shutil.copytree(tiny_llama_dir, directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.add_special_tokens({"eos_token": "<new-eos>"})
    tokenizer.save_pretrained(directory)
    with pytest.raises(ModelLoadError, match="does not match the model: its eos token '<new-eos>' is id"):
        load_causal_lm(str(directory), "fp32")


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
    monkeypatch.setattr(hub.hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf, "hub_reachable", lambda timeout_s: False)
    with pytest.raises(ModelLoadError, match="cannot be downloaded \\(no network\\)"):
        load_causal_lm(MISSING_HUB_NAME, "fp32")


def test_offline_flag_is_read_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hub.hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "yes")
    assert hf.hub_offline()
    monkeypatch.delenv("TRANSFORMERS_OFFLINE")
    assert not hf.hub_offline()


def test_unknown_dtype(tiny_llama_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="unknown dtype 'fp8'"):
        load_causal_lm(str(tiny_llama_dir), "fp8")  # type: ignore[arg-type]


def test_hub_name_offline_names_the_revision(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as raised:
        load_causal_lm(MISSING_HUB_NAME, "fp32", options=HubOptions(revision="v1.2"))
    message = str(raised.value)
    assert message.startswith(f"model '{MISSING_HUB_NAME}' at revision 'v1.2' is not a local directory")
    assert f"hf download {MISSING_HUB_NAME} --revision v1.2" in message


def _spy(monkeypatch: pytest.MonkeyPatch, module: object, names: tuple[str, ...]) -> list[tuple[str, dict]]:
    """Record the keyword arguments of each ``Auto*.from_pretrained`` in ``module``, then load."""
    seen: list[tuple[str, dict]] = []
    for name in names:
        auto = getattr(module, name)

        class Spy:
            original = auto

            @classmethod
            def from_pretrained(cls, source: object, **kwargs: object) -> object:
                seen.append((cls.original.__name__, dict(kwargs)))
                return cls.original.from_pretrained(source, **kwargs)

        monkeypatch.setattr(module, name, Spy)
    return seen


def test_revision_and_trust_remote_code_reach_every_from_pretrained(
    monkeypatch: pytest.MonkeyPatch, tiny_llama_dir: Path
) -> None:
    seen = _spy(monkeypatch, hf, ("AutoTokenizer", "AutoModelForCausalLM"))
    load_causal_lm(str(tiny_llama_dir), "fp32", options=HubOptions(revision="main", trust_remote_code=True))
    assert [name for name, _ in seen] == ["AutoTokenizer", "AutoModelForCausalLM"]
    for _, kwargs in seen:
        assert kwargs["revision"] == "main" and kwargs["trust_remote_code"] is True
    seen.clear()
    load_causal_lm(str(tiny_llama_dir), "fp32")
    # False, never None: None makes transformers ask on stdin
    assert all(kwargs["trust_remote_code"] is False and kwargs["revision"] is None for _, kwargs in seen)

    seen = _spy(monkeypatch, value_model, ("AutoTokenizer", "AutoConfig", "AutoModel"))
    value_model.load_scalar_model(str(tiny_llama_dir), options=HubOptions(revision="abc123", trust_remote_code=True))
    assert [name for name, _ in seen] == ["AutoTokenizer", "AutoConfig", "AutoModel"]
    assert all(kwargs["revision"] == "abc123" and kwargs["trust_remote_code"] is True for _, kwargs in seen)


CUSTOM_MODULE = '''
from transformers import LlamaConfig, LlamaForCausalLM


class CustomConfig(LlamaConfig):
    model_type = "flowrl_custom"


class CustomForCausalLM(LlamaForCausalLM):
    config_class = CustomConfig
'''


@pytest.fixture()
def custom_code_dir(tmp_path: Path, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tiny-llama under an architecture transformers lacks, its code in the folder (auto_map)."""
    # transformers copies a model's code into HF_MODULES_CACHE and imports it from there
    monkeypatch.setattr(dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    directory = tmp_path / "custom"
    shutil.copytree(tiny_llama_dir, directory)
    (directory / "custom_lm.py").write_text(CUSTOM_MODULE)
    config = json.loads((directory / "config.json").read_text())
    config["model_type"] = "flowrl_custom"
    config["architectures"] = ["CustomForCausalLM"]
    config["auto_map"] = {
        "AutoConfig": "custom_lm.CustomConfig",
        "AutoModelForCausalLM": "custom_lm.CustomForCausalLM",
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_a_model_with_its_own_code_needs_trust_remote_code(custom_code_dir: Path, tiny_llama_dir: Path) -> None:
    with pytest.raises(RemoteCodeNotTrusted) as raised:
        load_causal_lm(str(custom_code_dir), "fp32")
    assert str(raised.value).startswith(f"model '{custom_code_dir}' runs its own Python code")
    assert "set trust_remote_code: true on this model" in str(raised.value)

    model, tokenizer = load_causal_lm(str(custom_code_dir), "fp32", options=HubOptions(trust_remote_code=True))
    assert type(model).__name__ == "CustomForCausalLM" and tokenizer.padding_side == "left"
    reference, _ = load_causal_lm(str(tiny_llama_dir), "fp32")
    for key, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    with pytest.raises(RemoteCodeNotTrusted, match="trust_remote_code: true"):
        value_model.load_scalar_model(str(custom_code_dir), kind="value")


def test_a_worker_loads_with_the_models_revision_and_trust_remote_code(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict] = []

    def load(cls: type, name: str, path: str, **kwargs: object) -> object:
        calls.append(kwargs)
        return SimpleNamespace(module=torch.nn.Linear(2, 1))

    monkeypatch.setattr(ModelState, "load", classmethod(load))
    host = SimpleNamespace(device="cpu", device_name="cpu-0", base_dir=None, models={})
    spec = ModelSpec(path="org/model", kind="value", revision="refs/pr/7", trust_remote_code=True)
    RoleHost._load_model(host, "critic", spec, seed=0)  # type: ignore[arg-type]
    assert calls[0]["kind"] == "value"
    assert calls[0]["options"] == HubOptions(revision="refs/pr/7", trust_remote_code=True)


def test_a_mistyped_local_path_is_not_taken_for_a_hub_name(tmp_path: Path) -> None:
    # 'models/my-qwne' beside a folder models/: a local folder mistyped, said at once with the
    # nearest folder there, instead of minutes of hub retries
    (tmp_path / "models" / "my-qwen").mkdir(parents=True)
    with pytest.raises(ModelLoadError) as raised:
        resolve_any_model_path("models/my-qwne", tmp_path)
    assert "model directory 'models/my-qwne' not found" in str(raised.value)
    assert "holds my-qwen (did you mean 'models/my-qwen'?)" in str(raised.value)
    assert resolve_any_model_path("someorg/my-model", tmp_path) == "someorg/my-model"  # no such folder: a hub name


def _actor_pipeline(**actor: str) -> Any:
    """A GRPO pipeline of one model with these fields."""
    from flowrl.spec.loader import pipeline_from_dict

    return pipeline_from_dict({
        "name": "p", "models": {"actor": actor},
        "nodes": {"rollout": {"role": "generate", "model": "actor", "inputs": ["prompts"]},
                  "reward": {"role": "score", "fn": "digits", "inputs": ["rollout"]},
                  "adv": {"role": "advantage", "inputs": ["reward"]},
                  "train": {"role": "update", "model": "actor", "inputs": ["rollout", "adv"]}},
        "data": {"source": "builtin:digits"},
    })


def test_a_hub_name_neither_cached_nor_downloadable_is_a_problem_of_its_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from flowrl.api.checks import model_issues
    from flowrl.backends import policy_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    [(where, message)] = model_issues(_actor_pipeline(path=MISSING_HUB_NAME, revision="v1.2"), None)
    assert where == "models.actor.path"
    assert message.startswith(f"model '{MISSING_HUB_NAME}' at revision 'v1.2' is not a local directory nor in the "
                              "local Hugging Face cache")
    with pytest.raises(ModelLoadError, match="nor in the local Hugging Face cache"):
        policy_tokenizer.load_tokenizer(MISSING_HUB_NAME)


def test_a_policy_folder_without_tokenizer_files_is_a_problem_of_its_path(tmp_path: Path, tiny_llama_dir: Path) -> None:
    from flowrl.api.checks import model_issues

    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", bare / "config.json")  # the weights alone, as model.save_pretrained
    [(where, message)] = model_issues(_actor_pipeline(path=str(bare)), None)
    assert where == "models.actor.path"
    assert message == (f"model directory {bare} has no tokenizer files (tokenizer.json, tokenizer_config.json, ...); "
                       "save the tokenizer beside the weights (tokenizer.save_pretrained(DIR))")


def test_one_hub_probe_serves_the_checks_of_the_next_minute(monkeypatch: pytest.MonkeyPatch) -> None:
    """A command checks an uncached hub name several times (early check, preflight,
    tokenizer); offline each probe could wait its whole timeout, so one answer serves them."""
    asked: list[str] = []

    class Unreachable:
        def head(self, url: str, timeout: float) -> None:
            asked.append(url)
            raise ConnectionError("no network")

    monkeypatch.setattr(hub, "get_session", Unreachable)
    monkeypatch.setattr(hub, "_last_probe", None)
    assert [hub.hub_reachable(5.0) for _ in range(3)] == [False, False, False]
    assert len(asked) == 1
    # an answer older than HUB_PROBE_REUSE_S is not given again: the hub is asked anew
    monkeypatch.setattr(hub, "_last_probe", (time.monotonic() - hub.HUB_PROBE_REUSE_S - 1, True))
    assert hub.hub_reachable(5.0) is False and len(asked) == 2


def test_completions_end_at_every_eos_of_the_model_s_generation_config(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """An instruct model lists its end-of-turn token in generation_config.json beside the
    tokenizer's eos: a completion ends at the first of them, as generate() ends it."""
    from flowrl.data import PromptExample
    from flowrl.roles.generate import run_generate
    from flowrl.spec.schema import GenerateNode

    prompts = [PromptExample("ab=", "a"), PromptExample("qwerty=", "q"), PromptExample("zz=", "z")]
    node = GenerateNode(model="actor", inputs=["prompts"], n=1, max_new_tokens=24)

    def greedy(directory: Path) -> tuple[tuple[int, ...], list[list[int]]]:
        model, tokenizer = load_causal_lm(str(directory), "fp32")
        state = ModelState("actor", model, tokenizer, torch.device("cpu"), torch.Generator().manual_seed(0))
        rollout = run_generate(state, prompts, node, greedy=True).value
        rows = [[token for token, kept in zip(ids, mask) if kept]
                for ids, mask in zip(rollout.completion_ids.tolist(), rollout.completion_mask.tolist())]
        return hf.stop_token_ids(tokenizer, model), rows

    stops, free = greedy(tiny_llama_dir)
    assert stops == (2,)  # the tokenizer's <eos>; the builtin's generation config says the same
    counts: dict[int, int] = {}
    for row in free:
        for token in row[1:]:
            counts[token] = counts.get(token, 0) + 1
    turn_end = max(counts, key=lambda token: counts[token])  # a token most rows emit after their first

    directory = tmp_path / "instruct"
    shutil.copytree(tiny_llama_dir, directory)
    # a second eos id the model samples, and one past its embedding (never sampled: left out)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, turn_end, 10**6]}))
    stops, ended = greedy(directory)
    assert stops == (2, turn_end)
    for whole, cut in zip(free, ended):
        first = next((at for at, token in enumerate(whole) if token in (2, turn_end)), len(whole) - 1)
        assert cut == whole[:first + 1]  # the same tokens up to and with the first stop, none after
    assert any(len(cut) < len(whole) for whole, cut in zip(free, ended))


def test_a_saved_tokenizer_keeps_none_of_the_load_time_arguments(tmp_path: Path, tiny_llama_dir: Path) -> None:
    _, tokenizer = load_causal_lm(str(tiny_llama_dir), "fp32")
    assert tokenizer.init_kwargs.get("local_files_only") is True  # how it was loaded here
    hf.save_tokenizer(tokenizer, tmp_path)
    saved = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert not set(hf.LOAD_ONLY_KWARGS) & set(saved)
    assert saved["eos_token"] == tokenizer.eos_token
    assert tokenizer.init_kwargs.get("local_files_only") is True  # the loaded one is left as it was
