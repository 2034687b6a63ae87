"""Where a model path points, read without loading anything (no torch, no transformers): a
local folder or a hub name, and whether a folder is a saved model. The driver checks model
paths with these before any worker starts."""

from __future__ import annotations

from pathlib import Path

from flowrl.backends.cache import BUILTIN_PREFIX
from flowrl.backends.hub import HUB_NAME_PATTERN
from flowrl.errors import ModelLoadError


def resolve_model_path(path: str, base_dir: Path | None = None) -> Path | str:
    """Turn a model path into a local directory (Path) or a hub name (str).

    An existing directory is returned as a Path, ``base_dir / path`` winning over ``path``
    itself. Something shaped like a hub name is returned as the name; anything else is a
    missing local directory. ``builtin:NAME`` is ``flowrl.backends.models``'s to resolve (it
    builds the model); here it is an error.
    """
    if path.startswith(BUILTIN_PREFIX):
        raise ModelLoadError(
            f"'{path}' is a builtin model: load it through flowrl.backends.models (load_policy, "
            "load_scalar, resolve_model_path), which builds its folder"
        )
    candidates = [Path(path).expanduser()]
    if base_dir is not None and not candidates[0].is_absolute():
        candidates.insert(0, Path(base_dir) / candidates[0])
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
        if candidate.exists():
            raise ModelLoadError(
                f"model path '{path}' is a file ({candidate}); expected a directory holding "
                "config.json and the weights"
            )
    if HUB_NAME_PATTERN.match(path) and not path.startswith("."):
        return path
    looked_in = ", ".join(str(candidate) for candidate in candidates)
    raise ModelLoadError(
        f"model directory '{path}' not found (looked in {looked_in}); pass an existing "
        "directory, a hub name like 'org/name', or builtin:tiny-llama"
    )


def saved_model_location(path: str, base_dir: Path | None = None) -> Path | str:
    """:func:`resolve_model_path`, and a local folder must be a saved model (config.json)."""
    location = resolve_model_path(path, base_dir)
    if isinstance(location, Path) and not (location / "config.json").is_file():
        raise ModelLoadError(f"model directory {location} has no config.json; pass a directory written by "
                             "save_pretrained (config.json, weights and tokenizer files)")
    return location
