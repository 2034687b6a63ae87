"""What a checkpoint is, read from its config.json, against the kind a pipeline gives it: a
classifier is no policy, and a reward model needs one trained score."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flowrl.api.checks import model_issues
from flowrl.backends.model_facts import SCALAR_MARKER, kind_problem, model_facts
from flowrl.spec.loader import pipeline_from_dict


def _facts(tmp_path: Path, name: str, config: dict[str, Any], marker: bool = False) -> Any:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"vocab_size": 83, **config}))
    if marker:
        (folder / SCALAR_MARKER).write_text("{}")
    facts = model_facts(str(folder))
    assert facts is not None
    return facts


def test_a_classifier_is_refused_as_a_policy_and_a_language_model_as_a_reward_model(tmp_path: Path) -> None:
    causal = _facts(tmp_path, "lm", {"architectures": ["LlamaForCausalLM"]})
    one_label = _facts(tmp_path, "rm", {"architectures": ["LlamaForSequenceClassification"],
                                        "id2label": {"0": "LABEL_0"}})
    # transformers leaves the default two labels out of config.json
    two_labels = _facts(tmp_path, "rm2", {"architectures": ["LlamaForSequenceClassification"]})
    saved = _facts(tmp_path, "saved", {"architectures": ["LlamaModel"]}, marker=True)
    assert kind_problem(causal, "policy") is None and kind_problem(causal, "value") is None
    assert "holds a LlamaForSequenceClassification, a model that scores sequences" in str(kind_problem(one_label, "policy"))
    assert "scalar-head model (scalar_head.json)" in str(kind_problem(saved, "policy"))
    assert kind_problem(one_label, "reward") is None and kind_problem(saved, "reward") is None
    assert "with 2 labels: a reward model gives one score per completion" in str(kind_problem(two_labels, "reward"))
    assert "holds a LlamaForCausalLM with no trained score head" in str(kind_problem(causal, "reward"))
    assert kind_problem(two_labels, "value") is None  # a critic may start from any backbone


def test_an_encoder_decoder_model_is_refused_as_any_kind(tmp_path: Path) -> None:
    """T5 passed validation and failed at the run's sizing with a message naming no field."""
    t5 = _facts(tmp_path, "t5", {"architectures": ["T5ForConditionalGeneration"], "is_encoder_decoder": True})
    for kind in ("policy", "value", "reward"):
        assert ("holds a T5ForConditionalGeneration, an encoder-decoder model (is_encoder_decoder in its "
                "config.json): flowrl runs decoder-only models") in str(kind_problem(t5, kind))


def test_validation_places_a_wrong_kind_at_the_model_path(tmp_path: Path) -> None:
    _facts(tmp_path, "lm", {"architectures": ["LlamaForCausalLM"]})
    graph = pipeline_from_dict({
        "name": "p",
        "models": {"actor": {"path": "builtin:tiny-llama"}, "rm": {"path": "lm", "kind": "reward"}},
        "nodes": {
            "rollout": {"role": "generate", "model": "actor", "inputs": ["prompts"], "n": 2},
            "reward": {"role": "score", "model": "rm", "inputs": ["rollout"]},
            "adv": {"role": "advantage", "inputs": ["reward"]},
            "train": {"role": "update", "model": "actor", "inputs": ["rollout", "adv"]},
        },
        "data": {"source": "builtin:digits"},
    })
    [(field, message)] = model_issues(graph, tmp_path)
    assert field == "models.rm.path"
    assert message.startswith("lm holds a LlamaForCausalLM with no trained score head")
