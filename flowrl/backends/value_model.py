"""Scalar-head models: a transformer backbone plus ``Linear(hidden, 1)``, for critics and RMs.

A ``kind: value`` model (critic) reads one scalar per position; a ``kind: reward`` model reads
the scalar at the last real token. Both are :class:`ScalarHeadModel`. On disk one is a
directory::

    config.json  model.safetensors       the backbone (save_pretrained of a base model)
    tokenizer.json  tokenizer_config.json
    value_head.safetensors               the head: "weight" [1, hidden], "bias" [1]
    scalar_head.json                     marker: format, version, hidden size, what trained it

:func:`load_scalar_model` also reads what is not such a directory:

- ``builtin:NAME`` of a builtin policy (``builtin:tiny-llama``) or any causal-LM directory or
  cached hub name: its backbone, with a fresh head (weight and bias 0, so an untrained critic
  predicts 0 everywhere and adds no noise to the first advantages);
- a ``...ForSequenceClassification`` checkpoint with one label (the usual hub reward model):
  its backbone, with its ``score`` layer as the head;
- ``builtin:tiny-rm``: the builtin reward model (see :mod:`flowrl.backends.tiny_rm`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

from flowrl.backends.builtin import BUILTIN_PREFIX, quiet_progress_bars
from flowrl.backends.hf import TORCH_DTYPES, DtypeName, resolve_model_path
from flowrl.errors import ModelLoadError

HEAD_FILE = "value_head.safetensors"
"""The head's weights inside a scalar-model directory."""
MARKER_FILE = "scalar_head.json"
"""Marks a directory as a scalar-head model and records what trained the head."""
MARKER_FORMAT = "flowrl-scalar-head"
MARKER_VERSION = 1


class ScalarHeadModel(nn.Module):
    """A base transformer (no LM head) and a linear head giving one scalar per position."""

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

    def save_pretrained(self, directory: str | Path, **_: Any) -> None:
        """Write the weights as a scalar-model directory (no tokenizer), like a transformers model.

        Checkpoints call ``module.save_pretrained``; read the weights back with
        :func:`scalar_model_weights` (the backbone's file holds its keys without the
        ``backbone.`` prefix of this module's ``state_dict``).
        """
        save_scalar_model(self, None, Path(directory))

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


def save_scalar_model(
    model: ScalarHeadModel,
    tokenizer: PreTrainedTokenizerBase | None,
    directory: Path,
    trained_by: str = "",
) -> None:
    """Write ``model`` (and ``tokenizer``) as a directory :func:`load_scalar_model` reads back."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with quiet_progress_bars():
        model.backbone.save_pretrained(directory, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    head = {
        "weight": model.head.weight.detach().to("cpu", torch.float32).contiguous(),
        "bias": model.head.bias.detach().to("cpu", torch.float32).contiguous(),
    }
    save_file(head, str(directory / HEAD_FILE))
    marker = {
        "format": MARKER_FORMAT,
        "version": MARKER_VERSION,
        "hidden_size": int(model.backbone.config.hidden_size),
        "trained_by": trained_by,
    }
    (directory / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def scalar_model_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The ``state_dict`` of the :class:`ScalarHeadModel` saved in ``directory`` (checkpoints)."""
    directory = Path(directory)
    try:
        backbone = load_file(str(directory / "model.safetensors"))
        head = load_file(str(directory / HEAD_FILE))
    except OSError as error:
        raise ModelLoadError(
            f"{directory} is not a complete scalar-model directory (model.safetensors and "
            f"{HEAD_FILE}): {error}"
        ) from error
    weights = {f"backbone.{key}": value for key, value in backbone.items()}
    weights.update({f"head.{key}": value for key, value in head.items()})
    return weights


def has_trained_head(directory: Path) -> bool:
    """Whether ``directory`` holds a scalar head flowrl wrote (not just a backbone)."""
    return (Path(directory) / MARKER_FILE).is_file()


def resolve_scalar_model_path(
    path: str, base_dir: Path | None = None, cache_dir: Path | None = None
) -> Path | str:
    """Like :func:`flowrl.backends.hf.resolve_model_path`, plus the builtin scalar models."""
    if path.startswith(BUILTIN_PREFIX):
        # Imported here: tiny_rm builds on this module.
        from flowrl.backends.tiny_rm import BUILTIN_SCALAR_MODELS

        name = path[len(BUILTIN_PREFIX) :]
        if name in BUILTIN_SCALAR_MODELS:
            return BUILTIN_SCALAR_MODELS[name](cache_dir)
    return resolve_model_path(path, base_dir)


def load_scalar_model(
    path: str,
    dtype: DtypeName = "fp32",
    device: str = "cpu",
    base_dir: Path | None = None,
    require_trained_head: bool = False,
) -> tuple[ScalarHeadModel, PreTrainedTokenizerBase]:
    """Load a value or reward model and its tokenizer onto ``device`` in ``dtype``.

    ``require_trained_head`` (set it for ``kind: reward``) refuses a path whose head would be
    fresh: a reward model with an untrained head scores every completion 0.
    """
    if dtype not in TORCH_DTYPES:
        raise ModelLoadError(
            f"unknown dtype '{dtype}' for model '{path}'; expected one of {', '.join(TORCH_DTYPES)}"
        )
    location = resolve_scalar_model_path(path, base_dir)
    if isinstance(location, Path) and not (location / "config.json").is_file():
        raise ModelLoadError(
            f"model directory {location} has no config.json; pass a directory written by "
            "save_pretrained (config.json, weights and tokenizer files)"
        )
    source = str(location)
    torch_dtype = TORCH_DTYPES[dtype]
    try:
        with quiet_progress_bars():
            tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
            config = AutoConfig.from_pretrained(source, local_files_only=True)
            if isinstance(location, Path) and has_trained_head(location):
                model = ScalarHeadModel(
                    _load_backbone(source, torch_dtype, path), _read_head(location)
                )
            elif _is_single_label_classifier(config):
                model = _from_sequence_classifier(source, torch_dtype, path)
            else:
                if require_trained_head:
                    raise ModelLoadError(
                        f"model '{path}' has no trained scalar head (no {MARKER_FILE}, not a "
                        "...ForSequenceClassification checkpoint with one label), so as a reward "
                        "model it would score everything 0; use builtin:tiny-rm, a trained reward "
                        "model directory, or give it kind: value"
                    )
                model = ScalarHeadModel(_load_backbone(source, torch_dtype, path))
    except (OSError, ValueError, KeyError) as error:
        hint = (
            " (hub names are read from the local Hugging Face cache only; download the model "
            "and pass its directory)"
            if isinstance(location, str)
            else ""
        )
        raise ModelLoadError(
            f"cannot load scalar model '{path}' from {source}: {error}{hint}"
        ) from error
    _set_padding(tokenizer, path)
    return model.to(device), tokenizer


def _load_backbone(source: str, torch_dtype: torch.dtype, path: str) -> PreTrainedModel:
    """The base model of a checkpoint; its LM head, if any, is left unread."""
    with _quiet_load_report():
        backbone, info = AutoModel.from_pretrained(
            source, dtype=torch_dtype, local_files_only=True, output_loading_info=True
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


def _read_head(directory: Path) -> nn.Linear:
    try:
        tensors = load_file(str(directory / HEAD_FILE))
        weight, bias = tensors["weight"], tensors["bias"]
    except (OSError, KeyError) as error:
        raise ModelLoadError(
            f"{directory} is marked as a scalar model ({MARKER_FILE}) but its {HEAD_FILE} is "
            f"missing or lacks 'weight'/'bias': {error}; rebuild or re-save the model"
        ) from error
    head = nn.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.copy_(bias)
    return head


def _is_single_label_classifier(config: Any) -> bool:
    architectures = getattr(config, "architectures", None) or []
    return any(name.endswith("ForSequenceClassification") for name in architectures) and (
        getattr(config, "num_labels", 0) == 1
    )


def _from_sequence_classifier(source: str, torch_dtype: torch.dtype, path: str) -> ScalarHeadModel:
    with _quiet_load_report():
        classifier = AutoModelForSequenceClassification.from_pretrained(
            source, dtype=torch_dtype, local_files_only=True
        )
    score = getattr(classifier, "score", None)
    if not isinstance(score, nn.Linear):
        raise ModelLoadError(
            f"reward model '{path}' is a {type(classifier).__name__} without a linear 'score' "
            "layer; only decoder classifiers (Llama, Qwen, Mistral, ...) are supported"
        )
    head = nn.Linear(score.in_features, 1)
    with torch.no_grad():
        head.weight.copy_(score.weight)
        # Decoder classifiers have no bias on their score layer.
        head.bias.copy_(score.bias if score.bias is not None else torch.zeros(1))
    return ScalarHeadModel(classifier.base_model, head)


def _set_padding(tokenizer: PreTrainedTokenizerBase, path: str) -> None:
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelLoadError(
                f"the tokenizer of model '{path}' has neither a pad nor an eos token; "
                "batching needs a pad token"
            )
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
