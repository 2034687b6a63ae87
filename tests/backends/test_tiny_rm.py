"""builtin:tiny-rm: a short deterministic fit to the digits rule, cached, scoring like the rule."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from flowrl.backends.builtin import CACHE_ENV_VAR
from flowrl.backends.tiny_rm import (
    TASK_RULES,
    TinyRMRecipe,
    evaluate_fit,
    read_fit,
    tiny_rm_dir,
    train_tiny_rm,
)
from flowrl.backends.models import load_scalar
from flowrl.backends.value_model import load_scalar_model
from flowrl.data import BUILTIN_TASKS
from flowrl.errors import ModelLoadError
from flowrl.rewards import digit_match
from flowrl.roles.batch import Rollout
from flowrl.roles.reward_model import run_reward_model
from flowrl.roles.state import ModelState


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private cache holding tiny-rm, built once for the module (several seconds)."""
    root = tmp_path_factory.mktemp("flowrl-cache")
    tiny_rm_dir("digits", root)
    return root


def test_fit_is_recorded_and_holds_on_fresh_held_out_strings(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tiny_rm_dir("digits", cache)
    recorded = read_fit(directory)
    assert recorded.correlation > 0.8 and recorded.num_steps == TinyRMRecipe().num_steps
    monkeypatch.setenv(CACHE_ENV_VAR, str(cache))
    model, tokenizer = load_scalar("builtin:tiny-rm", kind="reward")
    fit = evaluate_fit(model, tokenizer, "digits", random.Random("a test's own strings"), 256)
    assert fit.correlation > 0.8
    assert fit.mse < 0.25 * fit.target_std**2  # explains more than 3/4 of the variance


def test_second_call_reuses_the_cache(cache: Path) -> None:
    directory = tiny_rm_dir("digits", cache)
    stamp = (directory / "model.safetensors").stat().st_mtime_ns
    assert tiny_rm_dir("digits", cache) == directory
    assert (directory / "model.safetensors").stat().st_mtime_ns == stamp


def test_it_is_a_transformers_sequence_classifier_scoring_like_flowrl(cache: Path) -> None:
    directory = tiny_rm_dir("digits", cache)
    assert directory.name == f"tiny-rm-digits-v{TinyRMRecipe().version}"
    opened = AutoModelForSequenceClassification.from_pretrained(directory)
    model, tokenizer = load_scalar_model(str(directory), kind="reward")
    encoded = tokenizer(
        ["abcdefgh=1234", "qwertyui=x9"], return_tensors="pt", padding=True, add_special_tokens=False
    )
    mask = encoded["attention_mask"]
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    with torch.no_grad():
        theirs = opened(input_ids=encoded["input_ids"], attention_mask=mask, position_ids=positions).logits[:, 0]
        ours = model(encoded["input_ids"], mask, positions)[:, -1]  # left-padded: the last column
    torch.testing.assert_close(theirs, ours)


def test_as_a_score_node_it_prefers_digits(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV_VAR, str(cache))
    model, tokenizer = load_scalar("builtin:tiny-rm")
    prompts = ["abcdefgh="] * 3
    completions = ["1234567890123456", "12345678abcdefgh", "abcdefghijklmnop"]
    prompt = tokenizer(prompts, return_tensors="pt", add_special_tokens=False)
    completion = tokenizer(completions, return_tensors="pt", add_special_tokens=False)
    rollout = Rollout(
        prompt_ids=prompt["input_ids"],
        prompt_mask=prompt["attention_mask"],
        completion_ids=completion["input_ids"],
        completion_mask=completion["attention_mask"],
        group_size=3,
        prompts=prompts,
        completions=completions,
        answers=[None] * 3,
        max_new_tokens=16,
        temperature=1.0,
    )
    state = ModelState("reward", model, tokenizer, torch.device("cpu"), torch.Generator())
    scores = run_reward_model(state, rollout, weight=1.0).value.values
    # Rule: 16/16 = 1.0, 8/16 = 0.5, 0/16 = 0.0.
    assert scores[0] > scores[1] > scores[2]
    assert abs(float(scores[0]) - 1.0) < 0.25 and abs(float(scores[2])) < 0.25


def test_same_recipe_same_weights() -> None:
    recipe = TinyRMRecipe(
        hidden_size=16,
        num_layers=1,
        num_heads=2,
        intermediate_size=32,
        num_steps=3,
        batch_size=8,
        num_eval=16,
    )
    first, _, _ = train_tiny_rm("digits", recipe)
    second, _, _ = train_tiny_rm("digits", recipe)
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), name


def test_rule_and_prompts_are_those_of_the_digits_task_and_reward() -> None:
    completions = ["1234567890123456", "12ab", "", "abc", "9" * 20, "1 2 3", "<unk>7"]
    expected = digit_match(completions=completions, max_new_tokens=16)
    rule = TASK_RULES["digits"]
    assert [rule.reward(c) for c in completions] == expected
    # Same prompt generator as the data source: same stream, same strings.
    ours, theirs = random.Random(3), random.Random(3)
    for _ in range(5):
        assert rule.make_prompt(ours) == BUILTIN_TASKS["digits"].make_example(theirs).prompt


def test_unknown_task_is_a_model_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="digits"):
        tiny_rm_dir("first_letter", tmp_path)
