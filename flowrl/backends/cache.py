"""Where built models and datasets are cached, and how an entry is written once (no torch:
the data layer and the planner use it).

Several processes may build the same entry at once: each writes a private temporary folder
next to the target and renames it into place; the loser of the race deletes its copy and uses
the winner's, which holds the same bytes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from flowrl.backends.catalog import builtin_folder
from flowrl.errors import FlowrlError, ModelLoadError

CACHE_ENV_VAR = "FLOWRL_CACHE"
BUILTIN_PREFIX = "builtin:"


def cache_root(cache_dir: Path | None = None) -> Path:
    """The cache root: ``cache_dir``, else ``$FLOWRL_CACHE``, else ``~/.cache/flowrl``."""
    if cache_dir is not None:
        return Path(cache_dir)
    from_env = os.environ.get(CACHE_ENV_VAR)
    if from_env:
        return Path(from_env)
    return Path.home() / ".cache" / "flowrl"


def make_readable(directory: Path) -> None:
    """Open the private temporary directory (mode 0700) to other users of a shared cache."""
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)


def write_once(
    target: Path, marker: str, build: Callable[[Path], None], what: str,
    error: type[FlowrlError] = ModelLoadError,
) -> Path:
    """``target``, written by ``build(folder)`` on first use. ``marker`` is the file ``build``
    writes last: its presence marks a complete entry. ``what`` names the entry in errors."""
    if (target / marker).is_file():
        return target
    if target.exists():
        # Only an atomic rename creates the target, so a target without its marker was made
        # by something else; never delete a folder flowrl did not write.
        raise error(f"the cache folder {target} exists but holds no {marker}; delete it and flowrl will build {what} again")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    except OSError as problem:
        raise error(
            f"cannot write {what} under {target.parent}: {problem}; set {CACHE_ENV_VAR} to a writable directory"
        ) from problem
    try:
        build(staging)
        make_readable(staging)
        try:
            os.rename(staging, target)
        except OSError:
            # Another process renamed its copy first; it was built the same way, use it.
            if not (target / marker).is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def built_builtin_dir(name: str, cache_dir: Path | None = None) -> Path | None:
    """The folder of builtin model ``name`` when it is built already, else None; without
    importing its builder (torch, transformers), so a process that only checks pays nothing."""
    folder, marker = builtin_folder(name)
    target = cache_root(cache_dir) / "models" / folder
    return target if (target / marker).is_file() else None
