"""A critic or reward model on disk: a transformers classification checkpoint with one label.

flowrl writes a :class:`~flowrl.backends.value_model.ScalarHeadModel` as the directory that
transformers' own classifier with ``num_labels=1`` would write, so other tools open it without
flowrl::

    config.json            the backbone's config; architectures [<Arch>ForTokenClassification]
                           for a head with a bias (a critic), [<Arch>ForSequenceClassification]
                           for one without (a reward model); num_labels 1
    model.safetensors      or model-0000i-of-0000N.safetensors + model.safetensors.index.json
                           (``trainer.max_shard_size``): "<prefix>.*" the backbone (prefix: its
                           base_model_prefix, "model" for Llama and Qwen2), "score.weight"
                           [1, hidden] and, for a critic, "score.bias" [1] ("classifier.*"
                           where the class calls its head that: GPT-2's token classifier)
    tokenizer files
    scalar_head.json       marker: format, version 2, backbone prefix, head name, hidden size,
                           what trained it

- ``AutoModelForTokenClassification.from_pretrained(dir)`` opens a critic: in eval mode (its
  dropout off) ``logits[..., 0]`` are the values flowrl computes at every position;
- ``AutoModelForSequenceClassification.from_pretrained(dir)`` opens a reward model:
  ``logits[:, 0]`` is the score at the last token that is not padding.

Which class follows from the head because transformers' sequence classifiers have no bias on
their ``score`` layer and its token classifiers have one: a reward model's head is bias-free,
a critic's is not.

Version 1 (flowrl before this format) kept the backbone's ``save_pretrained`` and the head in
``value_head.safetensors``; such directories (older checkpoints, critics) are still read.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import PreTrainedTokenizerBase
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
)

from flowrl.backends.hf import save_tokenizer
from flowrl.backends.builtin import quiet_progress_bars
from flowrl.backends.model_facts import SCALAR_MARKER
from flowrl.backends.weight_files import DEFAULT_MAX_SHARD_SIZE, read_weights, write_weights
from flowrl.errors import ModelLoadError

if TYPE_CHECKING:
    from flowrl.backends.value_model import ScalarHeadModel

MARKER_FILE = SCALAR_MARKER
"""Marks a directory as a scalar-head model flowrl wrote and records what trained the head."""
MARKER_FORMAT = "flowrl-scalar-head"
MARKER_VERSION = 2
"""2: a transformers classification checkpoint; 1: backbone + ``value_head.safetensors``."""
HEAD_FILE_V1 = "value_head.safetensors"
"""The head's weights ("weight", "bias") in a version-1 directory."""
SCORE = "score"
"""Name of the head in the checkpoint, as most of transformers' decoder classifiers call it
(Llama, Qwen, Mistral, and every sequence classifier)."""
HEAD_NAMES = (SCORE, "classifier")
"""What transformers' classifiers call their head: ``classifier`` in GPT-2's, GPT-NeoX's and
some other token classifiers."""


def classifier_head_name(config: Any, architecture: str) -> str:
    """The attribute transformers' class ``architecture`` keeps its one-label head in (built on
    the meta device from ``config``, no memory); ``score`` where the class is unknown."""
    import transformers

    model_class = getattr(transformers, architecture, None)
    if model_class is None:
        return SCORE
    labelled = copy.deepcopy(config)
    labelled.num_labels = 1
    try:
        with torch.device("meta"):
            built = model_class(labelled)
    except Exception:  # noqa: BLE001 - best effort: a class this config does not build (KeyError
        return SCORE  # from Cohere's, among others) keeps the name flowrl reads back itself
    return next((name for name in HEAD_NAMES if isinstance(getattr(built, name, None), nn.Linear)), SCORE)


def classifier_architecture(backbone_config: Any, with_bias: bool) -> str:
    """The transformers class a head with (token) or without (sequence) a bias is saved as."""
    names = (
        MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES
        if with_bias
        else MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES
    )
    known = names.get(getattr(backbone_config, "model_type", ""))
    if known:
        return str(known)
    # An architecture without such a class in transformers: the name it would have; flowrl
    # reads the directory back either way (the backbone with AutoModel, the head from the file).
    arch = (getattr(backbone_config, "architectures", None) or ["Model"])[0]
    stem = arch.split("For")[0].removesuffix("Model") or "Model"
    return f"{stem}For{'Token' if with_bias else 'Sequence'}Classification"


def save_scalar_model(
    model: ScalarHeadModel,
    tokenizer: PreTrainedTokenizerBase | None,
    directory: Path,
    trained_by: str = "",
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> None:
    """Write ``model`` (and ``tokenizer``) as a directory :func:`load_scalar_model` and
    transformers' classifier classes read back; weights in shards of at most ``max_shard_size``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    backbone, head = model.backbone, model.head
    with_bias = head.bias is not None
    config = copy.deepcopy(backbone.config)
    config.architectures = [classifier_architecture(config, with_bias)]
    config.num_labels = 1
    pad, eos = (tokenizer.pad_token_id, tokenizer.eos_token_id) if tokenizer is not None else (None, None)
    if getattr(config, "pad_token_id", None) is None and pad is not None and pad != eos:
        # transformers' sequence classifiers find each row's last token by the pad id, and
        # refuse a batch of several rows without one; an eos standing in as the pad would make
        # them score before a completion's own eos
        config.pad_token_id = pad
    head_name = classifier_head_name(config, config.architectures[0])
    prefix = backbone.base_model_prefix
    tensors = {f"{prefix}.{name}": tensor for name, tensor in backbone.state_dict().items()}
    tensors[f"{head_name}.weight"] = head.weight.detach()
    if head.bias is not None:
        tensors[f"{head_name}.bias"] = head.bias.detach()
    with quiet_progress_bars():
        config.save_pretrained(directory)
        write_weights(tensors, directory, max_shard_size)
        if tokenizer is not None:
            save_tokenizer(tokenizer, directory)
    marker = {
        "format": MARKER_FORMAT,
        "version": MARKER_VERSION,
        "backbone_prefix": prefix,
        "head": head_name,
        "hidden_size": int(backbone.config.hidden_size),
        "trained_by": trained_by,
    }
    (directory / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def has_trained_head(directory: Path) -> bool:
    """Whether ``directory`` holds a scalar head flowrl wrote (not just a backbone)."""
    return (Path(directory) / MARKER_FILE).is_file()


def read_marker(directory: Path) -> dict[str, Any]:
    """The marker's fields; its version says how the head and backbone are stored."""
    path = Path(directory) / MARKER_FILE
    try:
        marker = json.loads(path.read_text())
        if not isinstance(marker, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as error:
        raise ModelLoadError(
            f"{path} is not a readable scalar-model marker ({error}); re-save the model or "
            f"delete {MARKER_FILE} to use the directory's backbone with a fresh head"
        ) from error
    return marker


def read_head(directory: Path) -> nn.Linear:
    """The trained head saved in ``directory`` (either version), in float32."""
    directory = Path(directory)
    marker = read_marker(directory)
    version = marker.get("version", 1)
    bias: torch.Tensor | None
    try:
        if version == 1:
            tensors = load_file(str(directory / HEAD_FILE_V1))
            weight, bias = tensors["weight"], tensors["bias"]
        else:
            head_name = str(marker.get("head", SCORE))
            names = [f"{head_name}.weight", f"{head_name}.bias"]
            try:
                tensors = read_weights(directory, names)
            except KeyError:  # a reward model: no bias
                tensors = read_weights(directory, names[:1])
            weight, bias = tensors[names[0]], tensors.get(names[1])
    except (OSError, KeyError, ValueError) as error:
        raise ModelLoadError(
            f"{directory} is marked as a scalar model ({MARKER_FILE}, version {version}) but its "
            f"head is missing or incomplete: {error}; rebuild or re-save the model"
        ) from error
    return copy_head(weight, bias, with_bias=bias is not None)


def copy_head(weight: torch.Tensor, bias: torch.Tensor | None, with_bias: bool) -> nn.Linear:
    """A float32 ``Linear(hidden, 1)`` holding a copy of ``weight`` (and of ``bias``; 0 when
    asked for a bias that there is none of), detached from wherever they came from."""
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=with_bias)
    with torch.no_grad():
        head.weight.copy_(weight)
        if head.bias is not None:
            head.bias.copy_(bias if bias is not None else torch.zeros_like(head.bias))
    return head


def scalar_model_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The ``state_dict`` of the :class:`ScalarHeadModel` saved in ``directory`` (checkpoints)."""
    directory = Path(directory)
    marker = read_marker(directory)
    try:
        if marker.get("version", 1) == 1:
            backbone = load_file(str(directory / "model.safetensors"))
            head = load_file(str(directory / HEAD_FILE_V1))
            return {
                **{f"backbone.{key}": value for key, value in backbone.items()},
                **{f"head.{key}": value for key, value in head.items()},
            }
        saved = read_weights(directory)
    except (OSError, KeyError, ValueError) as error:
        raise ModelLoadError(
            f"{directory} is not a complete scalar-model directory: {error}"
        ) from error
    prefix = f"{marker.get('backbone_prefix', 'model')}."
    head_name = str(marker.get("head", SCORE))
    weights = {}
    for key, value in saved.items():
        if key.startswith(f"{head_name}."):
            weights[f"head.{key.removeprefix(f'{head_name}.')}"] = value
        elif key.startswith(prefix):
            weights[f"backbone.{key.removeprefix(prefix)}"] = value
        else:
            raise ModelLoadError(
                f"{directory} holds a tensor '{key}' that is neither the head ({head_name}.*) nor the "
                f"backbone ({prefix}*); re-save the model with flowrl"
            )
    return weights
