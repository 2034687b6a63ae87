"""Scalar-head models: fresh heads on causal-LM backbones, save/load, classifier checkpoints
(what flowrl saves opens with transformers' token and sequence classifiers), shards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
)

from flowrl.backends.builtin import CACHE_ENV_VAR
from flowrl.backends.models import load_scalar
from flowrl.backends.tokenizer import build_char_tokenizer
from flowrl.backends.value_model import (
    MARKER_FILE,
    ScalarHeadModel,
    load_scalar_model,
    save_scalar_model,
    scalar_model_weights,
)
from flowrl.errors import ModelLoadError
from flowrl.roles.state import ModelState
from tests.tiny_models import tiny_llama_config


@pytest.fixture()
def causal_lm_dir(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    model.save_pretrained(tmp_path / "lm")
    build_char_tokenizer().save_pretrained(tmp_path / "lm")
    return tmp_path / "lm"


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokenizer = build_char_tokenizer()
    encoded = tokenizer(
        ["abc=12", "q=7"],
        return_tensors="pt",
        padding=True,
        padding_side="left",
        add_special_tokens=False,
    )
    mask = encoded["attention_mask"]
    return encoded["input_ids"], mask, (mask.cumsum(dim=1) - 1).clamp(min=0)


def test_causal_lm_directory_gives_its_backbone_and_a_zero_head(causal_lm_dir: Path) -> None:
    model, tokenizer = load_scalar_model(str(causal_lm_dir))
    assert isinstance(model, ScalarHeadModel) and tokenizer.padding_side == "left"
    source = LlamaForCausalLM.from_pretrained(causal_lm_dir)
    for name, tensor in source.model.state_dict().items():
        assert torch.equal(model.backbone.state_dict()[name], tensor), name
    scalars = model(*_inputs())
    assert scalars.shape == (2, 6) and scalars.dtype == torch.float32
    assert torch.equal(scalars, torch.zeros(2, 6))


def test_save_and_load_round_trip(causal_lm_dir: Path, tmp_path: Path) -> None:
    model, tokenizer = load_scalar_model(str(causal_lm_dir))
    with torch.no_grad():
        model.head.weight.normal_(generator=torch.Generator().manual_seed(1))
        model.head.bias.fill_(0.25)
    save_scalar_model(model, tokenizer, tmp_path / "critic", trained_by="test")
    marker = json.loads((tmp_path / "critic" / MARKER_FILE).read_text())
    assert marker["hidden_size"] == 32 and marker["trained_by"] == "test"
    loaded, _ = load_scalar_model(str(tmp_path / "critic"), kind="reward")
    with torch.no_grad():
        torch.testing.assert_close(loaded(*_inputs()), model(*_inputs()))


def test_reward_model_without_a_trained_head_is_refused(causal_lm_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="no trained score head"):
        load_scalar_model(str(causal_lm_dir), kind="reward")


def test_single_label_sequence_classifier_keeps_its_score_layer(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = tiny_llama_config()
    config.num_labels = 1
    classifier = LlamaForSequenceClassification(config)
    classifier.save_pretrained(tmp_path / "rm")
    build_char_tokenizer().save_pretrained(tmp_path / "rm")
    model, _ = load_scalar_model(str(tmp_path / "rm"), kind="reward")
    input_ids = build_char_tokenizer()(["abc=12"], return_tensors="pt", add_special_tokens=False)[
        "input_ids"
    ]
    with torch.no_grad():
        expected = classifier(input_ids=input_ids).logits[:, 0]  # pooled at the last token
        ours = model(input_ids=input_ids)[:, -1]
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_bad_inputs_are_model_load_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="dtype"):
        load_scalar("builtin:tiny-llama", dtype="fp8")  # type: ignore[arg-type]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_scalar_model(str(tmp_path / "empty"))


def test_builtin_policy_backbone_and_the_optimizer_of_a_model_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "cache"))
    model, tokenizer = load_scalar("builtin:tiny-llama")
    assert model.config.hidden_size == 128
    state = ModelState(
        "critic", model, tokenizer, torch.device("cpu"), torch.Generator().manual_seed(0)
    )
    optimizer = state.ensure_optimizer(1e-3, (0.9, 0.999), 0.0)
    trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert id(model.head.weight) in trained and id(model.head.bias) in trained
    assert len(trained) == len(list(model.parameters()))


def test_checkpoint_style_save_pretrained_and_weights_restore_a_model_state(
    causal_lm_dir: Path, tmp_path: Path
) -> None:
    trained, tokenizer = load_scalar_model(str(causal_lm_dir))
    with torch.no_grad():
        trained.head.weight.fill_(0.1)
        trained.backbone.norm.weight.mul_(2.0)
    # As flowrl.runtime.checkpoint writes a model: module, then tokenizer.
    trained.save_pretrained(tmp_path / "step-1", safe_serialization=True)
    tokenizer.save_pretrained(tmp_path / "step-1")
    fresh, _ = load_scalar_model(str(causal_lm_dir))
    state = ModelState("critic", fresh, tokenizer, torch.device("cpu"), torch.Generator())
    state.load_weights(scalar_model_weights(tmp_path / "step-1"))
    with torch.no_grad():
        torch.testing.assert_close(fresh(*_inputs()), trained(*_inputs()))
    # The checkpoint directory is itself a loadable scalar model.
    reloaded, _ = load_scalar_model(str(tmp_path / "step-1"), kind="reward")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(*_inputs()), trained(*_inputs()))


def _trained_critic(causal_lm_dir: Path) -> tuple[ScalarHeadModel, object]:
    model, tokenizer = load_scalar_model(str(causal_lm_dir))
    with torch.no_grad():
        model.head.weight.normal_(generator=torch.Generator().manual_seed(2))
        model.head.bias.fill_(-0.3)
    return model, tokenizer


def test_a_saved_critic_opens_as_a_transformers_token_classifier(causal_lm_dir: Path, tmp_path: Path) -> None:
    critic, tokenizer = _trained_critic(causal_lm_dir)
    save_scalar_model(critic, tokenizer, tmp_path / "critic")
    config = json.loads((tmp_path / "critic" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForTokenClassification"] and len(config["id2label"]) == 1
    opened = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic")
    assert isinstance(opened, LlamaForTokenClassification) and not opened.training
    input_ids, mask, positions = _inputs()
    with torch.no_grad():
        theirs = opened(input_ids=input_ids, attention_mask=mask, position_ids=positions).logits[..., 0]
        torch.testing.assert_close(theirs, critic(input_ids, mask, positions))


def test_a_saved_reward_model_opens_as_a_transformers_sequence_classifier(
    causal_lm_dir: Path, tmp_path: Path
) -> None:
    backbone = LlamaForCausalLM.from_pretrained(causal_lm_dir).model
    head = torch.nn.Linear(32, 1, bias=False)
    torch.nn.init.normal_(head.weight, generator=torch.Generator().manual_seed(3))
    reward = ScalarHeadModel(backbone, head)
    save_scalar_model(reward, build_char_tokenizer(), tmp_path / "rm", trained_by="test")
    config = json.loads((tmp_path / "rm" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and len(config["id2label"]) == 1
    opened = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")
    assert isinstance(opened, LlamaForSequenceClassification)
    input_ids, mask, positions = _inputs()  # left-padded: the last column is every row's last token
    with torch.no_grad():
        theirs = opened(input_ids=input_ids, attention_mask=mask, position_ids=positions).logits[:, 0]
        ours = reward(input_ids, mask, positions)[:, -1]
    torch.testing.assert_close(theirs, ours)
    # flowrl reads it back as a reward model (no bias), and as a critic with a bias of 0 added
    loaded, _ = load_scalar_model(str(tmp_path / "rm"), kind="reward")
    assert loaded.head.bias is None
    as_critic, _ = load_scalar_model(str(tmp_path / "rm"), kind="value")
    assert as_critic.head.bias is not None and torch.equal(as_critic.head.bias.detach(), torch.zeros(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids, mask, positions), reward(input_ids, mask, positions))
        torch.testing.assert_close(as_critic(input_ids, mask, positions), reward(input_ids, mask, positions))


def test_a_scalar_model_above_the_shard_size_is_sharded_and_read_back(causal_lm_dir: Path, tmp_path: Path) -> None:
    from flowrl.backends.weight_files import INDEX_NAME, WEIGHTS_NAME

    critic, tokenizer = _trained_critic(causal_lm_dir)
    critic.save_pretrained(tmp_path / "step-1", max_shard_size="20KB")  # as checkpoints do
    shards = sorted(p.name for p in (tmp_path / "step-1").glob("model-*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert (tmp_path / "step-1" / INDEX_NAME).is_file() and not (tmp_path / "step-1" / WEIGHTS_NAME).exists()
    weights = scalar_model_weights(tmp_path / "step-1")
    assert weights.keys() == critic.state_dict().keys()
    for key, value in critic.state_dict().items():
        assert torch.equal(weights[key], value), key
    tokenizer.save_pretrained(tmp_path / "step-1")
    reloaded, _ = load_scalar_model(str(tmp_path / "step-1"))
    opened = AutoModelForTokenClassification.from_pretrained(tmp_path / "step-1")
    input_ids, mask, positions = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids, mask, positions), critic(input_ids, mask, positions))
        theirs = opened(input_ids=input_ids, attention_mask=mask, position_ids=positions).logits[..., 0]
        torch.testing.assert_close(theirs, critic(input_ids, mask, positions))


def test_a_version_1_directory_is_still_read(causal_lm_dir: Path, tmp_path: Path) -> None:
    """Critics and checkpoints written before the classifier format: backbone + value_head."""
    from safetensors.torch import save_file

    from flowrl.backends.scalar_files import HEAD_FILE_V1

    critic, tokenizer = _trained_critic(causal_lm_dir)
    old = tmp_path / "old"
    critic.backbone.save_pretrained(old)
    tokenizer.save_pretrained(old)
    save_file({"weight": critic.head.weight.detach(), "bias": critic.head.bias.detach()}, str(old / HEAD_FILE_V1))
    (old / MARKER_FILE).write_text(json.dumps({"format": "flowrl-scalar-head", "version": 1, "hidden_size": 32}))
    loaded, _ = load_scalar_model(str(old), kind="reward")
    with torch.no_grad():
        torch.testing.assert_close(loaded(*_inputs()), critic(*_inputs()))
    assert scalar_model_weights(old).keys() == critic.state_dict().keys()


def test_a_gpt2_critic_and_reward_model_open_as_transformers_classifiers(tmp_path: Path) -> None:
    """GPT-2's token classifier calls its head 'classifier': saved as 'score', transformers
    opened the critic with a fresh random head (values off by 0.45), without an error."""
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2ForTokenClassification

    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=32, n_embd=32, n_layer=2, n_head=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "lm")
    tokenizer.save_pretrained(tmp_path / "lm")
    critic, _ = load_scalar_model(str(tmp_path / "lm"))
    with torch.no_grad():
        critic.head.weight.normal_(generator=torch.Generator().manual_seed(2))
        critic.head.bias.fill_(-0.3)
    save_scalar_model(critic, tokenizer, tmp_path / "critic")
    opened = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic")
    assert isinstance(opened, GPT2ForTokenClassification)
    input_ids, mask, positions = _inputs()
    with torch.no_grad():
        theirs = opened(input_ids=input_ids, attention_mask=mask, position_ids=positions).logits[..., 0]
        torch.testing.assert_close(theirs, critic(input_ids, mask, positions))
    # flowrl reads it back, and a user's GPT-2 token classifier is taken as a critic too
    reloaded, _ = load_scalar_model(str(tmp_path / "critic"))
    opened.save_pretrained(tmp_path / "theirs")
    tokenizer.save_pretrained(tmp_path / "theirs")
    theirs_loaded, _ = load_scalar_model(str(tmp_path / "theirs"))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids, mask, positions), critic(input_ids, mask, positions))
        torch.testing.assert_close(theirs_loaded(input_ids, mask, positions), critic(input_ids, mask, positions))
    # a reward model (sequence classifier: 'score' in GPT-2's too)
    reward = ScalarHeadModel(critic.backbone, torch.nn.Linear(32, 1, bias=False))
    save_scalar_model(reward, tokenizer, tmp_path / "rm")
    scored = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")
    with torch.no_grad():
        torch.testing.assert_close(scored(input_ids=input_ids, attention_mask=mask, position_ids=positions).logits[:, 0],
                                   reward(input_ids, mask, positions)[:, -1])
