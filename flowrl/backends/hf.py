"""Loading causal language models and their tokenizers with transformers.

A model path in a pipeline is one of:

* ``builtin:NAME``: a builtin model, built locally on first use (see ``builtin.py``);
* a local directory holding ``config.json`` (relative paths are tried against the pipeline
  file's directory first, then the working directory);
* a Hugging Face hub name (``org/name``): taken from the local HF cache if it is there,
  otherwise downloaded, unless the hub is unreachable or ``HF_HUB_OFFLINE`` is set.

huggingface_hub retries a failed connection five times with back-off (about 25 s), so before an
online attempt one request with a short cap checks that the hub answers at all; without network
the user gets a ModelLoadError within ``HUB_PROBE_TIMEOUT_S`` instead of a long hang.

Every ``from_pretrained`` gets the model's :class:`HubOptions`: the hub ``revision`` (ignored for
a local directory) and ``trust_remote_code``, always passed as a bool: left at None, transformers
asks on stdin whether to run a model's own code, which would hang a worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import SafetensorError
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from flowrl.backends.hub import HUB_PROBE_TIMEOUT_S, hub_offline, hub_reachable
from flowrl.backends.locations import resolve_model_path, saved_model_location
from flowrl.backends.builtin import quiet_progress_bars
from flowrl.backends.dropout import disable_dropout
from flowrl.errors import ModelLoadError, RemoteCodeNotTrusted

LOAD_FAILURES = (OSError, ValueError, KeyError, RuntimeError, SafetensorError)
"""What ``from_pretrained`` raises for what the user passed: missing files and unknown
architectures (OSError, ValueError; KeyError for some unknown model types), weights of another
shape than config.json's (a RuntimeError), a damaged safetensors file (SafetensorError). Other
RuntimeErrors (memory, CUDA, a bug) are the machine's: :func:`user_load_failure` says which."""


def user_load_failure(error: BaseException) -> bool:
    """Whether ``error``, one of :data:`LOAD_FAILURES`, is the user's to fix, not the machine's:
    of the RuntimeErrors, only weights whose shapes differ from config.json's."""
    if isinstance(error, RuntimeError):
        return _mismatched_sizes(error)
    return True


def _mismatched_sizes(error: BaseException) -> bool:
    return "ignore_mismatched_sizes" in str(error) or "size mismatch" in str(error)


DtypeName = Literal["fp32", "bf16", "fp16"]

TORCH_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


@dataclass(frozen=True)
class HubOptions:
    """What ``from_pretrained`` needs of a model besides its path (``models.<m>`` in a pipeline)."""

    revision: str | None = None
    """Branch, tag or commit of a hub model; None: the default branch."""
    trust_remote_code: bool = False
    """Run Python code that comes with the model (``auto_map`` in its config)."""

    def kwargs(self, local_files_only: bool) -> dict[str, Any]:
        """Keyword arguments for every ``from_pretrained`` call (tokenizer, config, model)."""
        return {
            "revision": self.revision,
            "trust_remote_code": self.trust_remote_code,
            "local_files_only": local_files_only,
        }

    def describe(self, name: str) -> str:
        """``model 'org/name'``, with the revision when one is set (for error messages)."""
        return f"model '{name}'" + (f" at revision '{self.revision}'" if self.revision else "")


def load_causal_lm(
    path: str,
    dtype: DtypeName = "fp32",
    device: str = "cpu",
    base_dir: Path | None = None,
    options: HubOptions = HubOptions(),
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer onto ``device`` in ``dtype``.

    The tokenizer pads on the left (prompts for generation) and, when it has no pad token,
    pads with its eos token.
    """
    if dtype not in TORCH_DTYPES:
        raise ModelLoadError(
            f"unknown dtype '{dtype}' for model '{path}'; expected one of {', '.join(TORCH_DTYPES)}"
        )
    location = saved_model_location(path, base_dir)
    if isinstance(location, Path):
        if (location / "scalar_head.json").is_file():
            raise ModelLoadError(
                f"model '{path}' is a value/reward model (scalar head); give it kind: value or kind: reward"
            )
        model, tokenizer = _from_pretrained(
            str(location), dtype, path, options, local_files_only=True
        )
    else:
        model, tokenizer = _load_hub_model(location, dtype, options)
    set_padding(tokenizer, model, path)
    disable_dropout(model)
    # Module.to moves in place; called on the base class, whose signature mypy knows
    # (transformers wraps PreTrainedModel.to in a decorator that hides it).
    torch.nn.Module.to(model, torch.device(device))
    return model, tokenizer


def _load_hub_model(
    name: str, dtype: DtypeName, options: HubOptions
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """From the local HF cache if it is there, else from the hub when the hub answers."""
    try:
        return _from_pretrained(name, dtype, name, options, local_files_only=True)
    except RemoteCodeNotTrusted:
        raise  # in the cache, but refused: downloading it again would not help
    except ModelLoadError:
        pass
    if hub_offline() or not hub_reachable(HUB_PROBE_TIMEOUT_S):
        download = "download it elsewhere"
        if options.revision:
            download = (
                "download that revision elsewhere "
                f"(hf download {name} --revision {options.revision})"
            )
        raise ModelLoadError(
            f"{options.describe(name)} is not a local directory and cannot be downloaded "
            f"(no network): {download} and pass its directory, or use builtin:tiny-llama"
        )
    return _from_pretrained(name, dtype, name, options, local_files_only=False)


def _from_pretrained(
    source: str, dtype: DtypeName, shown_name: str, options: HubOptions, local_files_only: bool
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Both from_pretrained calls, with their failures turned into ModelLoadError."""
    kwargs = options.kwargs(local_files_only)
    try:
        with quiet_progress_bars():
            tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(
                source, dtype=TORCH_DTYPES[dtype], **kwargs
            )
    except LOAD_FAILURES as error:
        if not user_load_failure(error):
            raise
        raise load_error(shown_name, source, options, error) from error
    return model, tokenizer


def load_error(
    name: str, source: str, options: HubOptions, error: Exception, hint: str = ""
) -> ModelLoadError:
    """The ModelLoadError for a failed ``from_pretrained`` of model ``name`` from ``source``.

    transformers refuses a model that brings its own code, without ``trust_remote_code``,
    with a ValueError that names the argument; that one becomes :class:`RemoteCodeNotTrusted`,
    which says which pipeline setting allows it.
    """
    if not options.trust_remote_code and "trust_remote_code" in str(error):
        return RemoteCodeNotTrusted(
            f"{options.describe(name)} runs its own Python code ({source} names it in auto_map: "
            "an architecture transformers does not have), which flowrl runs only when allowed; "
            "if you trust that code, set trust_remote_code: true on this model "
            "(models.<name>.trust_remote_code in the pipeline)"
        )
    if _mismatched_sizes(error):
        # transformers' words name an argument of its own the user never set
        return ModelLoadError(f"cannot load {options.describe(name)} from {source}: its weights are not of the "
                              "shapes its config.json gives (saved from a model of another configuration); pass "
                              f"the config.json saved with them{hint}")
    return ModelLoadError(f"cannot load {options.describe(name)} from {source}: {error}{hint}")


def set_padding(tokenizer: PreTrainedTokenizerBase, model: torch.nn.Module, path: str) -> None:
    """Left padding, and eos as the pad token when the tokenizer has none or when its pad
    token lies outside the model's embedding (a tokenizer class that adds a pad token the
    model was never given rows for): padded positions are masked, but their ids are still
    looked up in the embedding. An eos outside the embedding is a tokenizer of another model."""
    rows = embedding_rows(model)
    eos = tokenizer.eos_token_id
    if rows is not None and eos is not None and eos >= rows:
        raise ModelLoadError(
            f"the tokenizer of model '{path}' does not match the model: its eos token {tokenizer.eos_token!r} "
            f"is id {eos}, but the model's embedding has {rows} rows; give the model the tokenizer it was "
            "trained with (the tokenizer files next to its config.json)"
        )
    pad = tokenizer.pad_token_id
    if tokenizer.pad_token is None or (rows is not None and pad is not None and pad >= rows):
        if tokenizer.eos_token is None:
            raise ModelLoadError(
                f"the tokenizer of model '{path}' has neither a usable pad token nor an eos token; "
                "batches need one of them to pad with"
            )
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    config = getattr(model, "generation_config", None)
    if config is not None and config.pad_token_id is None:
        config.pad_token_id = tokenizer.pad_token_id


def embedding_rows(model: torch.nn.Module) -> int | None:
    """Rows of the model's input embedding (its largest token id + 1), None when it has none
    that says; a scalar-head model's are its backbone's."""
    model = getattr(model, "backbone", model)
    get = getattr(model, "get_input_embeddings", None)
    try:
        embedding = get() if callable(get) else None
    except (AttributeError, NotImplementedError):
        return None
    return int(embedding.num_embeddings) if isinstance(embedding, torch.nn.Embedding) else None


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, model: torch.nn.Module) -> tuple[int, ...]:
    """The tokens that end a completion: the tokenizer's eos and every eos id of the model's
    generation config (``generation_config.json``), as ``generate()`` stops. An instruct
    model lists its end-of-turn token there (Llama 3's ``<|eot_id|>``, Qwen2.5's
    ``<|im_end|>`` beside ``<|endoftext|>``); stopping only at the tokenizer's eos would let a
    completion run on past its turn. Ids outside the model's embedding cannot be sampled and
    are left out."""
    config = getattr(model, "generation_config", None)
    listed = getattr(config, "eos_token_id", None)
    candidates = [tokenizer.eos_token_id, *(listed if isinstance(listed, (list, tuple)) else [listed])]
    rows = embedding_rows(model)
    ids: list[int] = []
    for token in candidates:
        if isinstance(token, int) and token >= 0 and (rows is None or token < rows) and token not in ids:
            ids.append(token)
    if not ids:
        raise ModelLoadError("the policy's tokenizer has no eos token and its generation config lists none: "
                             "completions could never end before max_new_tokens; give a tokenizer with an eos token")
    return tuple(ids)


LOAD_ONLY_KWARGS = ("local_files_only", "is_local", "revision", "trust_remote_code", "cache_dir", "token",
                    "_commit_hash")
"""What ``from_pretrained`` was told about where to load from, which transformers keeps among
a tokenizer's init arguments and would write into a saved ``tokenizer_config.json``."""


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, directory: str | Path) -> None:
    """``tokenizer.save_pretrained(directory)`` without the load-time arguments: a saved
    model that says ``local_files_only: true`` would keep whoever loads it from the hub
    from downloading its files."""
    kept = {key: tokenizer.init_kwargs.pop(key) for key in LOAD_ONLY_KWARGS if key in tokenizer.init_kwargs}
    try:
        tokenizer.save_pretrained(directory)
    finally:
        tokenizer.init_kwargs.update(kept)
