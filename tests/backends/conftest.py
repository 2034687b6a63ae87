"""Fixtures shared by the backend tests: one builtin tiny-llama, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.backends.builtin import builtin_model_dir


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private cache holding builtin:tiny-llama (never the user's ~/.cache)."""
    return builtin_model_dir("tiny-llama", tmp_path_factory.mktemp("flowrl-cache"))
