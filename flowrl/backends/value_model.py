"""Scalar-head models: a transformer backbone plus ``Linear(hidden, 1)``, for critics and RMs.

A ``kind: value`` model (critic) reads one scalar per position; a ``kind: reward`` model reads
the scalar at the last real token. Both are :class:`ScalarHeadModel`. On disk one is a
transformers classification checkpoint with one label (a critic ``...ForTokenClassification``,
a reward model ``...ForSequenceClassification``) plus flowrl's marker file: see
:mod:`flowrl.backends.scalar_files`.

:func:`load_scalar_model` also reads what is not such a directory:

- ``builtin:NAME`` of a builtin policy (``builtin:tiny-llama``) or any causal-LM directory or
  cached hub name: its backbone, with a fresh head (weight and bias 0, so an untrained critic
  predicts 0 everywhere and adds no noise to the first advantages);
- a ``...ForSequenceClassification`` or ``...ForTokenClassification`` checkpoint with one label
  (the usual hub reward model): its backbone, with its ``score`` layer as the head;
- ``builtin:tiny-rm``: the builtin reward model (see :mod:`flowrl.backends.tiny_rm`).

A critic's head always has a bias (a fresh one, or 0 added to a reward model's bias-free
``score``), so it can learn the returns' offset; a reward model's head is kept as it was saved.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

from flowrl.backends.builtin import quiet_progress_bars
from flowrl.backends.dropout import disable_dropout
from flowrl.backends.hf import (
    LOAD_FAILURES,
    TORCH_DTYPES,
    DtypeName,
    HubOptions,
    load_error,
    set_padding,
    user_load_failure,
)
from flowrl.backends.locations import saved_model_location
from flowrl.backends.model_facts import classifier_of, reward_head_problem
from flowrl.backends.scalar_files import (
    MARKER_FILE,
    HEAD_NAMES,
    copy_head,
    has_trained_head,
    read_head,
    save_scalar_model,
    scalar_model_weights,
)
from flowrl.backends.weight_files import DEFAULT_MAX_SHARD_SIZE
from flowrl.errors import ModelLoadError

__all__ = [
    "MARKER_FILE",
    "ScalarHeadModel",
    "ScalarKind",
    "has_trained_head",
    "load_scalar_model",
    "save_scalar_model",
    "scalar_model_weights",
]

ScalarKind = Literal["value", "reward"]
"""What a scalar model computes: per-position values (critic) or a sequence's reward."""


class ScalarHeadModel(nn.Module):
    """A base transformer (no LM head) and a linear head giving one scalar per position.

    ``head`` may lack a bias (a reward model saved as ``...ForSequenceClassification``); the
    fresh head made when none is given has one.
    """

    def __init__(self, backbone: PreTrainedModel, head: nn.Linear | None = None) -> None:
        super().__init__()
        hidden_size = int(backbone.config.hidden_size)
        if head is None:
            head = nn.Linear(hidden_size, 1)
            # Zero, not random: a critic that knows nothing yet predicts 0 for every state, and
            # the result does not depend on any RNG.
            nn.init.zeros_(head.weight)
            nn.init.zeros_(head.bias)
        if head.in_features != hidden_size or head.out_features != 1:
            raise ModelLoadError(
                f"scalar head has shape [{head.out_features}, {head.in_features}] but the "
                f"backbone's hidden size is {hidden_size}; expected [1, {hidden_size}]"
            )
        self.backbone = backbone
        self.head = head.to(dtype=backbone.dtype, device=backbone.device)

    @property
    def config(self) -> Any:
        return self.backbone.config

    def gradient_checkpointing_enable(self) -> None:
        self.backbone.gradient_checkpointing_enable()

    def save_pretrained(
        self, directory: str | Path, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, **_: Any
    ) -> None:
        """Write the weights as a scalar-model directory (no tokenizer), like a transformers model.

        Checkpoints call ``module.save_pretrained``; read the weights back with
        :func:`scalar_model_weights` (the file names the backbone's keys with its
        ``base_model_prefix`` and the head as the architecture's classifier names it: ``score``,
        or ``classifier`` in GPT-2's token classifier).
        """
        save_scalar_model(self, None, Path(directory), max_shard_size=max_shard_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """``[N, L]`` float32: the head applied to the last hidden state at every position."""
        kwargs.setdefault("use_cache", False)
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs
        ).last_hidden_state
        return self.head(hidden).squeeze(-1).float()


def load_scalar_model(
    path: str,
    dtype: DtypeName = "fp32",
    device: str = "cpu",
    base_dir: Path | None = None,
    kind: ScalarKind = "value",
    options: HubOptions = HubOptions(),
) -> tuple[ScalarHeadModel, PreTrainedTokenizerBase]:
    """Load a value or reward model and its tokenizer onto ``device`` in ``dtype``.

    A ``kind: reward`` model must come with a trained head: one with a fresh head would
    score every completion 0.
    """
    if dtype not in TORCH_DTYPES:
        raise ModelLoadError(
            f"unknown dtype '{dtype}' for model '{path}'; expected one of {', '.join(TORCH_DTYPES)}"
        )
    location = saved_model_location(path, base_dir)
    source = str(location)
    torch_dtype = TORCH_DTYPES[dtype]
    kwargs = options.kwargs(local_files_only=True)
    try:
        with quiet_progress_bars():
            tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
            config = AutoConfig.from_pretrained(source, **kwargs)
            classifier = _single_label_classifier(config)
            if isinstance(location, Path) and has_trained_head(location):
                backbone = _load_backbone(source, torch_dtype, path, kwargs)
                model = ScalarHeadModel(backbone, _head_for(kind, read_head(location)))
            elif classifier is not None:
                model = _from_classifier(classifier, source, torch_dtype, path, kind, kwargs)
            else:
                if kind == "reward":
                    architectures = list(getattr(config, "architectures", None) or [])
                    problem = reward_head_problem(architectures, getattr(config, "num_labels", None), False)
                    raise ModelLoadError(f"model '{path}' {problem}")
                model = ScalarHeadModel(_load_backbone(source, torch_dtype, path, kwargs))
    except LOAD_FAILURES as error:
        if not user_load_failure(error):
            raise
        hint = (
            " (hub names are read from the local Hugging Face cache only; download the model "
            "and pass its directory)"
            if isinstance(location, str)
            else ""
        )
        raise load_error(path, source, options, error, hint) from error
    set_padding(tokenizer, model, path)
    disable_dropout(model)
    return model.to(device), tokenizer


def _head_for(kind: ScalarKind, head: nn.Linear) -> nn.Linear:
    """A critic's head gets a bias (0) if the saved one had none; a reward model's stays."""
    if kind == "reward" or head.bias is not None:
        return head
    return copy_head(head.weight, None, with_bias=True)


def _load_backbone(
    source: str, torch_dtype: torch.dtype, path: str, kwargs: dict[str, Any]
) -> PreTrainedModel:
    """The base model of a checkpoint; its LM head or score layer, if any, is left unread."""
    with _quiet_load_report():
        backbone, info = AutoModel.from_pretrained(
            source, dtype=torch_dtype, output_loading_info=True, **kwargs
        )
    # An LM head in the checkpoint is expected and dropped; missing backbone weights are not
    # (they would stay randomly initialised without a word).
    if info.get("missing_keys"):
        missing = sorted(info["missing_keys"])
        raise ModelLoadError(
            f"model '{path}' lacks backbone weights {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}; "
            "pass a checkpoint of a transformer (causal LM or base model)"
        )
    return backbone


@contextmanager
def _quiet_load_report() -> Iterator[None]:
    # transformers logs a report listing the unused lm_head weight on every load of a
    # causal-LM checkpoint into a base model; the check above replaces it.
    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(before)


def _single_label_classifier(config: Any) -> type | None:
    """The Auto class of a checkpoint that is a one-label sequence or token classifier."""
    if getattr(config, "num_labels", 0) != 1:
        return None
    name = classifier_of(list(getattr(config, "architectures", None) or []))
    if name is None:
        return None
    return AutoModelForSequenceClassification if name.endswith("ForSequenceClassification") else AutoModelForTokenClassification


def _from_classifier(
    auto_class: type,
    source: str,
    torch_dtype: torch.dtype,
    path: str,
    kind: ScalarKind,
    kwargs: dict[str, Any],
) -> ScalarHeadModel:
    with _quiet_load_report():
        classifier = auto_class.from_pretrained(  # type: ignore[attr-defined]
            source, dtype=torch_dtype, **kwargs
        )
    score = next((layer for name in HEAD_NAMES if isinstance(layer := getattr(classifier, name, None), nn.Linear)),
                 None)
    if score is None:
        raise ModelLoadError(
            f"model '{path}' is a {type(classifier).__name__} without a linear head "
            f"({' or '.join(HEAD_NAMES)}); only decoder classifiers (Llama, Qwen, Mistral, GPT-2, ...) are supported"
        )
    # Decoder sequence classifiers have no bias on their score layer; a critic gets one (0).
    head = copy_head(score.weight, score.bias, with_bias=kind == "value" or score.bias is not None)
    return ScalarHeadModel(classifier.base_model, head)
