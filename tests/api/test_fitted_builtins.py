"""A run says so before it fits a built-in model (minutes without a line look like a hang)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.api.run import _builtins_to_fit
from flowrl.backends.catalog import builtin_folder
from flowrl.spec.loader import load_pipeline

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"


def test_only_fitted_builtins_missing_from_the_cache_are_announced(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path))
    assert _builtins_to_fit(load_pipeline(PIPELINES / "ppo_tiny.yaml")) == ["builtin:tiny-rm"]
    assert _builtins_to_fit(load_pipeline(PIPELINES / "grpo_arith.yaml")) == ["builtin:arith-llama"]
    assert _builtins_to_fit(load_pipeline(PIPELINES / "grpo_tiny.yaml")) == []  # random init: instant
    folder, marker = builtin_folder("arith-llama")
    (tmp_path / "models" / folder).mkdir(parents=True)
    (tmp_path / "models" / folder / marker).write_text("{}")
    assert _builtins_to_fit(load_pipeline(PIPELINES / "grpo_arith.yaml")) == []


def test_an_unknown_builtin_is_left_to_the_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path))
    graph = load_pipeline(PIPELINES / "grpo_tiny.yaml", ["models.actor.path=builtin:no-such-model"])
    assert _builtins_to_fit(graph) == []
