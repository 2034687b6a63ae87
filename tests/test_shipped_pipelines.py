"""Every pipeline file shipped in pipelines/ validates."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.spec.loader import load_pipeline
from flowrl.spec.schema import GenerateNode, UpdateNode

PIPELINES = sorted((Path(__file__).parent.parent / "pipelines").glob("*.yaml"))


def test_the_shipped_set() -> None:
    assert {path.name for path in PIPELINES} >= {
        "grpo_tiny.yaml",
        "grpo_first_letter.yaml",
        "ppo.yaml",
    }


@pytest.mark.parametrize("path", PIPELINES, ids=lambda path: path.name)
def test_pipeline_validates(path: Path) -> None:
    graph = load_pipeline(path)
    assert graph.nodes_of(GenerateNode)


def test_grpo_tiny_is_the_documented_default() -> None:
    spec = load_pipeline(Path(__file__).parent.parent / "pipelines" / "grpo_tiny.yaml").spec
    assert spec.models["actor"].path == "builtin:tiny-llama"
    assert spec.devices["actor_group"].type == "cpu"
    rollout = spec.nodes["rollout"]
    assert isinstance(rollout, GenerateNode)
    assert (rollout.n, rollout.max_new_tokens, rollout.temperature) == (8, 16, 1.0)
    train = spec.nodes["train"]
    assert isinstance(train, UpdateNode)
    assert (train.lr, train.kl_coef, train.kl_estimator) == (5e-4, 0.02, "k3")
    assert (spec.data.source, spec.data.batch_size) == ("builtin:digits", 4)
    assert (spec.trainer.steps, spec.trainer.output_dir, spec.trainer.seed) == (
        120,
        "outputs/grpo-tiny",
        0,
    )
