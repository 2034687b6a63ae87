"""The policy's tokenizer, for the driver: rendering chat prompts and measuring their length.

The driver needs only the tokenizer (the weights load on the workers), read from the same
place the model comes from: a builtin model's folder, a local folder, or the local cache of
a hub name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from flowrl.backends.builtin import quiet_progress_bars
from flowrl.backends.locations import hub_model_problem
from flowrl.backends.models import resolve_model_path
from flowrl.errors import ModelLoadError


def load_tokenizer(
    path: str, base_dir: Path | None = None, revision: str | None = None, trust_remote_code: bool = False
) -> Any:
    """The tokenizer of the model at ``path``, padding on the left with eos when it has no pad."""
    location = resolve_model_path(path, base_dir)
    if isinstance(location, str) and (problem := hub_model_problem(location, revision)) is not None:
        raise ModelLoadError(problem)  # at once, not after the hub client's retries
    try:
        with quiet_progress_bars():
            tokenizer = AutoTokenizer.from_pretrained(
                str(location), revision=revision, trust_remote_code=trust_remote_code,
                local_files_only=isinstance(location, Path),
            )
    except (OSError, ValueError, KeyError) as error:
        raise ModelLoadError(f"cannot load the tokenizer of model '{path}': {error}") from error
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer
