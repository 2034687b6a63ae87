"""What a model's config.json says about the sequences it can take and what it is, read
without loading the model (no torch): the positions a sequence may span, the token ids its
embedding has rows for, its architecture. Validation compares them with the pipeline's lengths,
with the policy's, and with the model's ``kind``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowrl.backends.cache import BUILTIN_PREFIX
from flowrl.backends.catalog import lookup_builtin
from flowrl.backends.locations import read_config, resolve_model_path
from flowrl.errors import ModelLoadError

SCALAR_MARKER = "scalar_head.json"
"""Beside a value or reward model that flowrl saved: its trained scalar head's format."""
CLASSIFIER_SUFFIXES = ("ForSequenceClassification", "ForTokenClassification")
"""Architectures whose head scores a sequence (or each token) instead of predicting tokens."""

POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
"""Where configs keep the longest sequence (Llama and most; GPT-2; others), first found wins."""


@dataclass(frozen=True)
class ModelFacts:
    positions: int | None
    """Longest sequence (prompt + completion) in tokens; None when the config does not say."""
    vocabulary: int | None
    """Rows of the input embedding (``vocab_size``); None when the config does not say."""
    source: str
    """Where the numbers come from, for messages: ``its config.json`` or a builtin's shape."""
    architectures: tuple[str, ...] = ()
    """The config's ``architectures`` (the class the weights were saved from)."""
    labels: int | None = None
    """A classifier's outputs per position (``id2label``'s size, else ``num_labels``)."""
    scalar_head: bool = False
    """A scalar head flowrl saved lies beside it (:data:`SCALAR_MARKER`)."""
    encoder_decoder: bool = False
    """The config says ``is_encoder_decoder`` (T5, BART): not a decoder-only model."""


def model_facts(path: str, base_dir: Path | None = None, revision: str | None = None) -> ModelFacts | None:
    """The facts of the model at ``path`` (builtin name, local folder, or hub name in the local
    cache); None where no config can be read here."""
    if path.startswith(BUILTIN_PREFIX):
        shape = lookup_builtin(path[len(BUILTIN_PREFIX):])
        return ModelFacts(shape.max_position_embeddings, shape.vocabulary, "its builtin shape")
    location = resolve_model_path(path, base_dir)
    config_file = _config_file(location, revision)
    if config_file is None:
        return None
    try:
        config = read_config(config_file.parent)
    except ModelLoadError:
        return None
    # a multimodal config keeps the language model's numbers in text_config
    nested = config.get("text_config")
    text: dict[str, Any] = nested if isinstance(nested, dict) else config
    architectures = config.get("architectures")
    labels = config.get("id2label")
    return ModelFacts(
        config_positions(text), _number(text.get("vocab_size")), "its config.json",
        tuple(name for name in architectures if isinstance(name, str)) if isinstance(architectures, list) else (),
        len(labels) if isinstance(labels, dict) else _number(config.get("num_labels")),
        (config_file.parent / SCALAR_MARKER).is_file(),
        config.get("is_encoder_decoder") is True,
    )


def classifier_of(architectures: tuple[str, ...] | list[str]) -> str | None:
    """The first of ``architectures`` whose head scores instead of predicting tokens, or None."""
    return next((name for name in architectures if name.endswith(CLASSIFIER_SUFFIXES)), None)


def kind_problem(facts: ModelFacts, kind: str) -> str | None:
    """Why a model of these facts cannot serve as ``kind`` (policy, reward), or None: a
    classifier as a policy (its language-model head would start random), a reward model
    without one trained score, an encoder-decoder model as anything. A critic (value) may start
    from any decoder-only backbone."""
    if facts.encoder_decoder:
        what = f"a {facts.architectures[0]}" if facts.architectures else "a model"
        return (f"holds {what}, an encoder-decoder model (is_encoder_decoder in its config.json): flowrl runs "
                "decoder-only models; give a causal language model (...ForCausalLM) or a classifier built on one")
    classifier = classifier_of(facts.architectures)
    if kind == "policy" and (classifier or facts.scalar_head):
        what = f"a {classifier}" if classifier else f"a scalar-head model ({SCALAR_MARKER})"
        return (f"holds {what}, a model that scores sequences: as a policy it has no trained language-model "
                "head (transformers would start one at random); give a causal language model (...ForCausalLM), "
                "or kind: reward for this one")
    if kind == "reward":
        return reward_head_problem(facts.architectures, facts.labels, facts.scalar_head)
    return None


def reward_head_problem(architectures: tuple[str, ...] | list[str], labels: int | None, scalar_head: bool) -> str | None:
    """Why a checkpoint has no one trained score to serve as a reward model, or None."""
    if scalar_head:
        return None
    classifier = classifier_of(architectures)
    labels = 2 if labels is None else labels  # transformers' default, left out of config.json
    if classifier is not None and labels == 1:
        return None
    if classifier is not None:
        return (f"holds a {classifier} with {labels} labels: a reward model gives one score per completion; "
                "give a classifier with one label (num_labels=1) or a reward model flowrl saved")
    what = f"a {architectures[0]}" if architectures else "a model"
    return (f"holds {what} with no trained score head (no {SCALAR_MARKER}, not a ...ForSequenceClassification or "
            "...ForTokenClassification with one label): as a reward model it would give every completion the "
            "same score; give a trained reward model (or builtin:tiny-rm to try the pipeline)")


def _config_file(location: Path | str, revision: str | None) -> Path | None:
    if isinstance(location, Path):
        found = location / "config.json"
        return found if found.is_file() else None
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(location, "config.json", revision=revision)
    return Path(cached) if isinstance(cached, str) else None


def config_positions(config: dict[str, Any]) -> int | None:
    """The longest sequence a model of this config (as a dict) reads, None when it does not say."""
    positions = next((value for key in POSITION_KEYS if (value := _number(config.get(key))) is not None), None)
    # A scaled rotary embedding (YaRN, dynamic, linear) reaches past the trained positions:
    # ``rope_scaling`` before transformers 5, ``rope_parameters`` since. On the side of
    # allowing, since the config's own number may or may not include the factor already.
    factors = [_factor(config.get(key)) for key in ("rope_scaling", "rope_parameters")]
    factor = max((value for value in factors if value is not None), default=None)
    if positions is not None and factor is not None and factor > 1:
        return int(positions * factor)
    return positions


def _factor(scaling: object) -> float | None:
    """The scaling factor of a rope_scaling / rope_parameters entry (a dict, or one dict per
    attention kind); None without one."""
    if not isinstance(scaling, dict):
        return None
    value = scaling.get("factor")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    nested = [_factor(item) for item in scaling.values() if isinstance(item, dict)]
    return max((item for item in nested if item is not None), default=None)


def _number(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        return None
    return int(value)
