"""Lengths past a model's positions and models that cannot read the policy's token ids are
refused before any worker loads a model (flowrl.api.model_fit)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from flowrl.api.model_fit import model_fit_issues, prompt_room
from flowrl.spec.loader import pipeline_from_dict
from tests.tiny_models import ordered_char_tokenizer


def _pipeline(actor: str = "builtin:tiny-llama", reference: str = "builtin:tiny-llama", new_tokens: int = 16,
              data: dict[str, Any] | None = None, evaluation: dict[str, Any] | None = None) -> Any:
    spec: dict[str, Any] = {
        "name": "p",
        "models": {"actor": {"path": actor}, "reference": {"path": reference}},
        "nodes": {
            "rollout": {"role": "generate", "model": "actor", "inputs": ["prompts"], "n": 2,
                        "max_new_tokens": new_tokens},
            "reward": {"role": "score", "fn": "digits", "inputs": ["rollout"]},
            "ref": {"role": "reference_logprob", "model": "reference", "inputs": ["rollout"]},
            "adv": {"role": "advantage", "inputs": ["reward"]},
            "train": {"role": "update", "model": "actor", "inputs": ["rollout", "adv", "ref"], "kl_coef": 0.1},
        },
        "data": {"source": "builtin:digits", **(data or {})},
    }
    if evaluation is not None:
        spec["eval"] = {"every_steps": 5, **evaluation}
    return pipeline_from_dict(spec)


def _folder(root: Path, name: str, config: dict[str, Any], tokenizer: Any = None) -> str:
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return str(folder)


def test_a_completion_that_fills_the_positions_leaves_no_room_for_a_prompt(tmp_path: Path) -> None:
    # builtin:tiny-llama takes 256 positions
    assert model_fit_issues(_pipeline(new_tokens=255), None) == []
    [(field, message)] = model_fit_issues(_pipeline(new_tokens=256), None)
    assert field == "nodes.rollout.max_new_tokens"
    assert "256 new tokens leave no room for a prompt" in message and "at most 256 tokens" in message
    [(field, _)] = model_fit_issues(_pipeline(evaluation={"max_new_tokens": 300}), None)
    assert field == "eval.max_new_tokens"
    # held-out sequences are the policy's alone: a shorter reference does not bound them
    short = _folder(tmp_path, "short", {"vocab_size": 83, "n_positions": 40})
    assert model_fit_issues(_pipeline(reference=short, evaluation={"max_new_tokens": 200}), None) == []


def test_a_prompt_limit_that_with_the_completion_passes_the_positions_is_refused() -> None:
    assert model_fit_issues(_pipeline(new_tokens=200, data={"max_prompt_tokens": 56}), None) == []
    [(field, message)] = model_fit_issues(_pipeline(new_tokens=200, data={"max_prompt_tokens": 57}), None)
    assert field == "data.max_prompt_tokens"
    assert "make 257, more than the 256 tokens" in message and "to 56 or less" in message


def test_the_shortest_model_and_the_longest_completion_set_the_room(tmp_path: Path) -> None:
    short = _folder(tmp_path, "short", {"vocab_size": 83, "n_positions": 40})  # GPT-2's key
    pipeline = _pipeline(reference=short, new_tokens=16, evaluation={"max_new_tokens": 24})
    room = prompt_room(pipeline, None)
    assert room is not None and room.tokens == 40 - 16
    assert "model 'reference' takes at most 40 tokens" in room.why and "nodes.rollout.max_new_tokens is 16" in room.why
    # held-out prompts: the policy's 256 positions and the evaluation's own 24 new tokens
    room = prompt_room(pipeline, None, evaluation=True)
    assert room is not None and room.tokens == 256 - 24 and "eval.max_new_tokens is 24" in room.why
    # a scaled rotary embedding reaches past the config's positions, as transformers 4 and 5 write it
    for key in ("rope_scaling", "rope_parameters"):
        scaled = _folder(tmp_path, f"scaled-{key}", {"vocab_size": 83, "max_position_embeddings": 40,
                                                     key: {"rope_type": "yarn", "factor": 2.5}})
        room = prompt_room(_pipeline(reference=scaled), None)
        assert room is not None and room.tokens == 100 - 16 and "at most 100 tokens" in room.why


def test_a_prompt_longer_than_the_room_stops_the_run_before_step_1(tmp_path: Path) -> None:
    from flowrl.api.data import policy_formatter, training_source
    from flowrl.errors import DataError

    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "1+1="}) + "\n" + json.dumps({"prompt": "9" * 300}) + "\n")
    graph = _pipeline(data={"source": "train.jsonl"})
    with pytest.raises(DataError) as caught:
        training_source(graph, tmp_path, policy_formatter(graph, tmp_path))
    message = str(caught.value)
    assert "row 2: 300 tokens" in message and "row 1" not in message
    assert "longer than the 240 tokens" in message and "set data.overlong_prompts: truncate_left or skip" in message
    # truncate_left alone cuts at that room: the prompt's last 240 tokens
    graph = _pipeline(data={"source": "train.jsonl", "overlong_prompts": "truncate_left"})
    source = training_source(graph, tmp_path, policy_formatter(graph, tmp_path))
    assert [example.prompt for example in source.examples] == ["1+1=", "9" * 240]
    # with a limit of its own, the prompt limit applies as the data section says
    graph = _pipeline(data={"source": "train.jsonl", "max_prompt_tokens": 100, "overlong_prompts": "skip"})
    source = training_source(graph, tmp_path, policy_formatter(graph, tmp_path))
    assert [example.prompt for example in source.examples] == ["1+1="]


def test_a_model_with_fewer_token_ids_than_the_policy_has_tokens_is_refused(tmp_path: Path) -> None:
    [(field, message)] = model_fit_issues(_pipeline(actor="builtin:qwen2-0.4b", reference="builtin:tiny-llama"), None)
    assert field == "models.reference.path"
    assert "has 83 token ids" in message and "the embedding of the policy 'actor' has 32000" in message
    # more rows than the policy has tokens: every id it samples has one
    assert model_fit_issues(_pipeline(actor="builtin:tiny-llama", reference="builtin:qwen2-0.4b"), None) == []
    # an embedding padded past the tokenizer (Qwen2.5 7B's 152064 rows, 3B's 151936, one
    # tokenizer): the policy's tokenizer counts, not its embedding
    tokenizer = ordered_char_tokenizer("upeabc")
    padded = _folder(tmp_path, "padded", {"vocab_size": 64, "max_position_embeddings": 64}, tokenizer)
    smaller = _folder(tmp_path, "smaller", {"vocab_size": 8, "max_position_embeddings": 64}, tokenizer)
    assert model_fit_issues(_pipeline(actor=padded, reference=smaller), None) == []
    tight = _folder(tmp_path, "tight", {"vocab_size": 5, "max_position_embeddings": 64})
    [(field, message)] = model_fit_issues(_pipeline(actor=padded, reference=tight), None)
    assert "has 5 token ids" in message and "the tokenizer of the policy 'actor' has 6" in message


def test_a_tokenizer_that_gives_the_policy_tokens_other_ids_is_refused(tmp_path: Path) -> None:
    tokenizer = ordered_char_tokenizer
    config = {"vocab_size": 6, "max_position_embeddings": 64}
    actor = _folder(tmp_path, "actor", config, tokenizer("upeabc"))
    same = _folder(tmp_path, "same", config, tokenizer("upeabc"))
    swapped = _folder(tmp_path, "swapped", config, tokenizer("upecba"))
    assert model_fit_issues(_pipeline(actor=actor, reference=same), None) == []
    [(field, message)] = model_fit_issues(_pipeline(actor=actor, reference=swapped), None)
    assert field == "models.reference.path"
    assert "2 of the 6 tokens of 'actor' have another id there (token 'a' is 3 for 'actor', 5 for 'reference')" in message


def test_held_out_lengths_are_measured_against_the_evaluations_reward_models_too(tmp_path: Path) -> None:
    """A reward model that scores the held-out completions reads them: an evaluation's
    completions past its positions are refused, as past the policy's."""
    short_rm = _folder(tmp_path, "rm", {"vocab_size": 83, "n_positions": 64,
                                        "architectures": ["LlamaForSequenceClassification"], "num_labels": 1})

    def pipeline(scores: list[str] | None) -> Any:
        return pipeline_from_dict({
            "name": "p",
            "models": {"actor": {"path": "builtin:tiny-llama"}, "rm": {"path": short_rm, "kind": "reward"}},
            "nodes": {
                "rollout": {"role": "generate", "model": "actor", "inputs": ["prompts"], "n": 2, "max_new_tokens": 16},
                "score": {"role": "score", "model": "rm", "inputs": ["rollout"]},
                "digits": {"role": "score", "fn": "digits", "inputs": ["rollout"]},
                "adv": {"role": "advantage", "inputs": ["score", "digits"]},
                "train": {"role": "update", "model": "actor", "inputs": ["rollout", "adv"]},
            },
            "data": {"source": "builtin:digits"},
            "eval": {"source": "held.jsonl", "max_new_tokens": 100, "scores": scores},
        })

    [(field, message)] = model_fit_issues(pipeline(None), None)
    assert field == "eval.max_new_tokens" and "model 'rm' takes at most 64 tokens" in message
    assert model_fit_issues(pipeline(["digits"]), None) == []  # only the policy (256 positions) reads them


def test_a_builtin_model_beside_a_local_model_of_another_tokenizer_is_refused(tmp_path: Path) -> None:
    # builtin models read the character tokenizer's ids (<pad> <bos> <eos> <unk> a-z ...)
    config = {"vocab_size": 100, "max_position_embeddings": 64}
    own = _folder(tmp_path, "own", config, ordered_char_tokenizer("upeabc"))
    [(field, message)] = model_fit_issues(_pipeline(actor=own, reference="builtin:tiny-llama"), None)
    assert field == "models.reference.path"
    assert "the tokenizer of model 'reference' (builtin:tiny-llama) is not the policy's" in message
    [(field, message)] = model_fit_issues(_pipeline(actor="builtin:tiny-llama", reference=own), None)
    assert field == "models.reference.path"
    assert "of the 83 tokens of 'actor' have another id there" in message


def test_a_local_copy_of_a_builtin_model_reads_the_builtin_ids(tmp_path: Path) -> None:
    from flowrl.backends.tokenizer import build_char_tokenizer

    config = {"vocab_size": 83, "max_position_embeddings": 64}
    copy = _folder(tmp_path, "copy", config, build_char_tokenizer())
    assert model_fit_issues(_pipeline(actor=copy, reference="builtin:tiny-llama"), None) == []
    assert model_fit_issues(_pipeline(actor="builtin:tiny-llama", reference=copy), None) == []


def test_a_reward_model_of_another_tokenizer_reads_the_texts_with_retokenize(tmp_path: Path) -> None:
    rm = _folder(tmp_path, "rm", {"vocab_size": 100, "max_position_embeddings": 64, "num_labels": 1,
                                  "architectures": ["LlamaForSequenceClassification"]}, ordered_char_tokenizer("upeabc"))

    def pipeline(retokenize: bool) -> Any:
        return pipeline_from_dict({
            "name": "p",
            "models": {"actor": {"path": "builtin:tiny-llama"}, "rm": {"path": rm, "kind": "reward"}},
            "nodes": {
                "rollout": {"role": "generate", "model": "actor", "inputs": ["prompts"], "n": 2, "max_new_tokens": 16},
                "score": {"role": "score", "model": "rm", "inputs": ["rollout"], "retokenize": retokenize},
                "adv": {"role": "advantage", "inputs": ["score"]},
                "train": {"role": "update", "model": "actor", "inputs": ["rollout", "adv"]},
            },
            "data": {"source": "builtin:digits"},
        })

    [(field, message)] = model_fit_issues(pipeline(False), None)
    assert field == "models.rm.path" and "is not the policy's" in message
    assert message.endswith("or set retokenize: true on score node 'score' (it then reads each prompt and completion "
                            "as text with the reward model's own tokenizer)")
    assert model_fit_issues(pipeline(True), None) == []
    # a second score node of the same model that reads the policy's ids: checked again
    both = pipeline(True).spec.model_dump(mode="json", exclude_unset=True)
    both["nodes"]["again"] = {"role": "score", "model": "rm", "inputs": ["rollout"]}
    both["nodes"]["adv"]["inputs"].append("again")
    [(field, message)] = model_fit_issues(pipeline_from_dict(both), None)
    assert field == "models.rm.path" and "is not the policy's" in message


def test_retokenize_belongs_to_a_reward_model() -> None:
    from flowrl.errors import SpecError

    with pytest.raises(SpecError, match="retokenize reads the texts with a reward model's own tokenizer"):
        pipeline_from_dict({
            "name": "p", "models": {"actor": {"path": "builtin:tiny-llama"}},
            "nodes": {
                "rollout": {"role": "generate", "model": "actor", "inputs": ["prompts"]},
                "score": {"role": "score", "fn": "digits", "inputs": ["rollout"], "retokenize": True},
                "adv": {"role": "advantage", "inputs": ["score"]},
                "train": {"role": "update", "model": "actor", "inputs": ["rollout", "adv"]},
            },
            "data": {"source": "builtin:digits"},
        })
