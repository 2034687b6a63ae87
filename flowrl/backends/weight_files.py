"""A model directory's safetensors weights, in one file or in shards.

transformers writes a model no bigger than ``max_shard_size`` as one ``model.safetensors``
and a bigger one as ``model-00001-of-0000N.safetensors`` ... plus ``model.safetensors.index.json``,
whose ``weight_map`` names the file of every tensor. flowrl writes (checkpoints, ``final/``,
scalar models) and reads (resume, scalar heads) both forms through this module, so the
two never disagree on names.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from pathlib import Path

import torch
from huggingface_hub import save_torch_state_dict
from safetensors import safe_open

WEIGHTS_NAME = "model.safetensors"
"""The weights of a model written as one file."""
INDEX_NAME = "model.safetensors.index.json"
"""The index of a sharded model: ``{"weight_map": {tensor name: shard file}}``."""

DEFAULT_MAX_SHARD_SIZE = "5GB"
"""The default of ``trainer.max_shard_size`` (repeated from the schema, which imports no torch)."""

_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
_SIZE = re.compile(r"^([1-9][0-9]*)(KB|MB|GB|KiB|MiB|GiB)$")


def shard_size_bytes(size: str) -> int:
    """``trainer.max_shard_size`` (``500MB``, ``2GiB``) in bytes.

    Converted here rather than passed on as text: huggingface_hub's parser, which
    ``save_pretrained`` uses, knows KB/MB/GB but not the binary KiB/MiB/GiB the schema allows.
    """
    match = _SIZE.match(size.strip())
    if match is None:
        raise ValueError(
            f"max_shard_size '{size}' is not a size; expected a whole number and a unit "
            f"({', '.join(_UNITS)}), like 500MB or 2GiB"
        )
    return int(match.group(1)) * _UNITS[match.group(2)]


def has_weights(directory: Path) -> bool:
    """Whether ``directory`` holds safetensors weights, whole or sharded."""
    return (directory / WEIGHTS_NAME).is_file() or (directory / INDEX_NAME).is_file()


def weight_map(directory: Path) -> dict[str, str]:
    """Tensor name -> the file under ``directory`` that holds it.

    Raises FileNotFoundError when there are no weights and ValueError for an index that is
    not transformers' format.
    """
    index = directory / INDEX_NAME
    if (directory / WEIGHTS_NAME).is_file():
        with safe_open(str(directory / WEIGHTS_NAME), framework="pt") as handle:
            return {name: WEIGHTS_NAME for name in handle.keys()}
    if not index.is_file():
        raise FileNotFoundError(f"{directory} has neither {WEIGHTS_NAME} nor {INDEX_NAME}")
    try:
        mapping = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"{index} is not a safetensors index (no 'weight_map'): {error}"
        ) from error
    if not isinstance(mapping, dict):
        raise ValueError(f"{index}: 'weight_map' is not a mapping of tensor names to files")
    return {str(name): str(file) for name, file in mapping.items()}


def read_weights(directory: Path, names: Collection[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of the model in ``directory`` (only ``names``, when given), on the CPU.

    Only the shards that hold a wanted tensor are opened. A name that is not there raises
    KeyError; a missing shard FileNotFoundError.
    """
    located = weight_map(directory)
    wanted = located.keys() if names is None else names
    missing = [name for name in wanted if name not in located]
    if missing:
        raise KeyError(f"{directory} holds no tensor {', '.join(sorted(missing)[:5])}")
    by_file: dict[str, list[str]] = {}
    for name in wanted:
        by_file.setdefault(located[name], []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for file, file_names in by_file.items():
        path = directory / file
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing ({INDEX_NAME} names it)")
        with safe_open(str(path), framework="pt") as handle:
            for name in file_names:
                tensors[name] = handle.get_tensor(name)
    return tensors


def write_weights(
    tensors: dict[str, torch.Tensor], directory: Path, max_shard_size: int | str
) -> None:
    """Write ``tensors`` as ``save_pretrained`` would: one file, or shards and an index
    (earlier weight files in ``directory`` are removed first, as ``save_pretrained`` does)."""
    limit = shard_size_bytes(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
    save_torch_state_dict(tensors, directory, max_shard_size=limit)


def weights_problem(directory: Path, expected: dict[str, tuple[int, ...]] | None = None,
                    prefix: str = "") -> str | None:
    """Why the safetensors weights in ``directory`` cannot be loaded, or None: a file whose
    header or length is damaged (a copy or download that did not finish), a shard the index
    names that is missing, or, given ``expected`` (tensor name -> shape, as the model built
    from its config.json has them; ``prefix``: the model's base prefix, which checkpoints
    may or may not write before its names), a tensor of another shape. Only headers are
    read. A directory without safetensors weights (``pytorch_model.bin``) is not checked, nor
    the shapes of quantized weights (``quantization_config``: packed, not as the config's)."""
    from safetensors import SafetensorError

    if not has_weights(directory):
        return None
    try:
        located = weight_map(directory)
    except (SafetensorError, OSError, ValueError) as error:
        # the one weights file, else the shards' index, is what could not be read
        read = directory / (WEIGHTS_NAME if (directory / WEIGHTS_NAME).is_file() else INDEX_NAME)
        return f"{read} is damaged ({error}): copy or download it again"
    for file in sorted(set(located.values())):
        path = directory / file
        if not path.is_file():
            return f"{path} is missing ({INDEX_NAME} names it): copy or download the model again"
        try:
            with safe_open(str(path), framework="pt") as handle:
                shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
        except (SafetensorError, OSError) as error:
            return f"{path} is damaged ({error}): copy or download it again"
        for name, shape in shapes.items():
            want = _expected_shape(expected or {}, name, prefix)
            if want is not None and want != shape:
                return (f"{path} holds {name} of shape {list(shape)}, but config.json makes it {list(want)}: "
                        "the weights were saved from a model of another configuration; pass the config.json "
                        "saved with them")
    return None


def _expected_shape(expected: dict[str, tuple[int, ...]], name: str, prefix: str) -> tuple[int, ...] | None:
    # checkpoints are written with or without the base model's prefix ("model.")
    if name in expected:
        return expected[name]
    if prefix and name.startswith(prefix + "."):
        return expected.get(name[len(prefix) + 1:])
    return expected.get(f"{prefix}.{name}") if prefix else None
