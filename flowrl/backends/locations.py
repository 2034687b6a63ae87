"""Where a model path points, read without loading anything (no torch, no transformers): a
local folder or a hub name, and whether a folder is a saved model. The driver checks model
paths with these before any worker starts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flowrl.backends.cache import BUILTIN_PREFIX
from flowrl.backends.hub import HUB_NAME_PATTERN, HUB_PROBE_TIMEOUT_S, hub_offline, hub_reachable
from flowrl.errors import ModelLoadError
from flowrl.spec.lines import nearest_beside


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
    looked_in = ", ".join(str(candidate) for candidate in candidates)
    parent = next((candidate.parent for candidate in candidates if candidate.parent.is_dir() and "/" in path), None)
    if HUB_NAME_PATTERN.match(path) and not path.startswith(".") and parent is None:
        return path
    # 'models/my-qwne' where a folder models/ is at hand: a local path mistyped, not a hub name
    near = ""
    if parent is not None:
        siblings = sorted(entry.name for entry in parent.iterdir() if entry.is_dir())
        close = nearest_beside(parent / Path(path).name, folders=True, cutoff=0.6)
        near = f"; {parent} holds {', '.join(siblings[:8]) or 'no folders'}" + (
            f" (did you mean '{str(Path(path).parent / close.name)}'?)" if close else "")
    raise ModelLoadError(
        f"model directory '{path}' not found (looked in {looked_in}){near}; pass an existing "
        "directory, a hub name like 'org/name', or builtin:tiny-llama"
    )


def hub_model_problem(name: str, revision: str | None = None, base_dir: Path | None = None) -> str | None:
    """Why hub model ``name`` cannot be loaded here (not in the local cache and the hub
    unreachable), or None: asked once, before any worker waits on the hub's retries. A name
    close to a model folder in ``base_dir`` or the working directory is asked about."""
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json", revision=revision), str):
        return None
    if hub_offline() or not hub_reachable(HUB_PROBE_TIMEOUT_S):
        at = f" at revision '{revision}'" if revision else ""
        fetch = f"hf download {name}" + (f" --revision {revision}" if revision else "")
        return (f"model '{name}'{at} is not a local directory{_near_folder(name, base_dir)} nor in the local "
                "Hugging Face cache, and the hub cannot be reached (no network): download it elsewhere "
                f"({fetch}) and pass its directory, or use builtin:tiny-llama")
    return None


def _near_folder(name: str, base_dir: Path | None) -> str:
    """`` (did you mean the folder 'mymodel' here?)`` for a mistyped local name read as a hub name."""
    if "/" in name:
        return ""  # org/name: not a folder of one of these
    for parent in dict.fromkeys([base_dir, Path.cwd()]):  # the pipeline's folder first
        if parent is None:
            continue
        close = nearest_beside(parent / name, folders=True, cutoff=0.6, keep=lambda entry: (entry / "config.json").is_file())
        if close is not None:
            return f" (did you mean the model folder '{close.name}' here?)"
    return ""


def saved_model_location(path: str, base_dir: Path | None = None) -> Path | str:
    """:func:`resolve_model_path`, and a local folder must be a saved model (config.json)."""
    location = resolve_model_path(path, base_dir)
    if isinstance(location, Path) and not (location / "config.json").is_file():
        raise ModelLoadError(f"model directory {location} has no config.json; pass a directory written by "
                             "save_pretrained (config.json, weights and tokenizer files)")
    return location


def read_config(location: Path) -> dict[str, Any]:
    """The settings in model folder ``location``'s config.json; a ModelLoadError says why they
    cannot be read (unreadable, not JSON, not an object). The one reader of a folder's config
    for validation, the planner and the model facts."""
    config = location / "config.json"
    try:
        text = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError) as error:
        raise ModelLoadError(f"{config} cannot be read ({error})") from None
    except ValueError as error:
        raise ModelLoadError(f"{config} is not valid JSON ({error}); pass the config.json save_pretrained wrote") from None
    if not isinstance(text, dict):
        raise ModelLoadError(f"{config} holds a {type(text).__name__}, not an object of settings; pass the "
                             "config.json save_pretrained wrote")
    return text


def config_problem(location: Path) -> str | None:
    """Why the config.json of model folder ``location`` cannot be read, or None."""
    try:
        read_config(location)
    except ModelLoadError as error:
        return str(error)
    return None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
"""Any of these in a model folder: a tokenizer was saved there."""


def tokenizer_problem(location: Path) -> str | None:
    """Why the policy model folder ``location`` has no tokenizer to load, or None. Without
    one, transformers builds an empty tokenizer from config.json alone, and every prompt
    would tokenize to nothing."""
    if any((location / name).is_file() for name in TOKENIZER_FILES):
        return None
    return (f"model directory {location} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...); save the "
            "tokenizer beside the weights (tokenizer.save_pretrained(DIR))")

