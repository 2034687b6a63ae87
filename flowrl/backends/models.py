"""Every model path a pipeline may give, to a loaded model: ``builtin:NAME`` (built here on
first use, whatever its recipe), a local folder, or a hub name.

This module sits above every builder (``builtin``, ``arith_model``, ``tiny_rm``) and both
loaders (``hf`` for causal LMs, ``value_model`` for scalar-head models), so that none of those
needs another to find a builtin model's folder::

    "builtin:tiny-rm" --catalog: recipe tiny-rm--> tiny_rm_dir() --> folder --> value_model.load_scalar_model
    "org/name" or a folder -----------------------------------------------> hf / value_model loaders
"""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from flowrl.backends.arith_model import arith_model_dir
from flowrl.backends.builtin import builtin_model_dir
from flowrl.backends.cache import BUILTIN_PREFIX
from flowrl.backends.catalog import lookup_builtin
from flowrl.backends.hf import DtypeName, HubOptions, load_causal_lm
from flowrl.backends.hf import resolve_model_path as local_or_hub
from flowrl.backends.tiny_rm import tiny_rm_dir
from flowrl.backends.value_model import ScalarHeadModel, ScalarKind, load_scalar_model


def builtin_dir(name: str, cache_dir: Path | None = None) -> Path:
    """The folder of builtin model ``name`` (``BUILTIN_MODELS``), built on first use."""
    recipe = lookup_builtin(name).recipe
    if recipe == "arith":
        return arith_model_dir(cache_dir)
    if recipe == "tiny-rm":
        return tiny_rm_dir("digits", cache_dir)
    return builtin_model_dir(name, cache_dir)


def resolve_model_path(path: str, base_dir: Path | None = None) -> Path | str:
    """A builtin model's folder, a local folder (Path) or a hub name (str)."""
    if path.startswith(BUILTIN_PREFIX):
        return builtin_dir(path[len(BUILTIN_PREFIX):])
    return local_or_hub(path, base_dir)


def load_policy(
    path: str, dtype: DtypeName = "fp32", device: str = "cpu", base_dir: Path | None = None,
    options: HubOptions = HubOptions(),
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A causal LM and its tokenizer from any model path."""
    return load_causal_lm(str(resolve_model_path(path, base_dir)), dtype, device, base_dir, options)


def load_scalar(
    path: str, dtype: DtypeName = "fp32", device: str = "cpu", base_dir: Path | None = None,
    kind: ScalarKind = "value", options: HubOptions = HubOptions(),
) -> tuple[ScalarHeadModel, PreTrainedTokenizerBase]:
    """A value or reward model and its tokenizer from any model path."""
    return load_scalar_model(str(resolve_model_path(path, base_dir)), dtype, device, base_dir, kind, options)
