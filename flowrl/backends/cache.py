"""Where built models and datasets are cached, and how a cache entry becomes readable to
other users (no torch: the data layer and the planner use it)."""

from __future__ import annotations

import os
from pathlib import Path

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
