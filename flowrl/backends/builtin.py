"""Builtin models: small random-init Llamas with the character tokenizer, built locally.

``builtin:tiny-llama`` in a pipeline resolves to a directory that
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load like any
checkpoint. The directory is built on first use from a fixed seed, so every machine (and every
Dask worker) gets byte-identical weights without a download, and is cached::

    <cache root>/models/<name>-v<version>/
        config.json  generation_config.json  model.safetensors
        tokenizer.json  tokenizer_config.json

The cache root is the ``cache_dir`` argument, else ``$FLOWRL_CACHE``, else ``~/.cache/flowrl``.
Several processes may build the same model at once: each writes a private temporary directory
next to the target and renames it into place; the loser of the race deletes its copy and uses
the winner's, which holds the same bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen2Config
from transformers.utils import logging as hf_logging

from flowrl.backends.cache import BUILTIN_PREFIX, CACHE_ENV_VAR, cache_root, make_readable, write_once
from flowrl.backends.catalog import BUILTIN_MODELS, BuiltinModel, builtin_folder, lookup_builtin
from flowrl.backends.tokenizer import build_char_tokenizer
from flowrl.errors import ModelLoadError

__all__ = ["BUILTIN_MODELS", "BUILTIN_PREFIX", "CACHE_ENV_VAR", "BuiltinModel", "cache_root", "lookup_builtin", "make_readable"]


def model_config(shape: BuiltinModel, vocab_size: int, pad_token_id: int, bos_token_id: int,
                 eos_token_id: int) -> PretrainedConfig:
    """The transformers config for this shape and the given vocabulary."""
    config_class = Qwen2Config if shape.architecture == "qwen2" else LlamaConfig
    return config_class(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        intermediate_size=shape.intermediate_size,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=shape.tie_word_embeddings,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )


def builtin_model_dir(name: str, cache_dir: Path | None = None) -> Path:
    """The directory of builtin model ``name``, building it on first use.

    ``name`` is given without the ``builtin:`` prefix (it is stripped if present).
    """
    if name.startswith(BUILTIN_PREFIX):
        name = name[len(BUILTIN_PREFIX):]
    shape = lookup_builtin(name)
    if shape.recipe != "init":
        raise ModelLoadError(f"builtin model '{name}' is fitted, not initialised: load it as 'builtin:{name}'")
    folder, marker = builtin_folder(name)
    target = cache_root(cache_dir) / "models" / folder
    return write_once(target, marker, lambda staging: write_builtin(shape, staging), f"'{name}'")


def build_builtin(name: str, cache_dir: Path | None = None) -> Path:
    """Alias of :func:`builtin_model_dir`."""
    return builtin_model_dir(name, cache_dir)


def write_builtin(shape: BuiltinModel, directory: Path) -> None:
    """Build the model from its seed and save it (safetensors) with the tokenizer."""
    tokenizer = build_char_tokenizer(shape.vocab_size)
    config = model_config(
        shape,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    # fork_rng keeps the caller's global RNG stream untouched by the seeded init.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(shape.seed)
        model = AutoModelForCausalLM.from_config(config)
    with quiet_progress_bars():
        model.to(torch.float32).save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)


@contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """Hide transformers' shard progress bars (noise for small models), then restore the setting."""
    were_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if were_enabled:
            hf_logging.enable_progress_bar()
