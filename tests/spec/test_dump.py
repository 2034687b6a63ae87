"""to_yaml writes readable YAML that loads back to an equal pipeline."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.spec.dump import to_yaml
from flowrl.spec.loader import load_pipeline, pipeline_from_dict

PIPELINES = sorted((Path(__file__).parents[2] / "pipelines").glob("*.yaml"))


def reload(text: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    path = tmp_path / "dumped.yaml"
    path.write_text(text)
    return load_pipeline(path)


def test_exact_layout_omits_defaults(tmp_path: Path) -> None:
    graph = pipeline_from_dict(
        {
            "name": "small",
            "models": {"actor": {"path": "builtin:tiny-llama", "device_group": "cpus"}},
            "devices": {"cpus": {"type": "cpu"}},
            "nodes": {
                "rollout": {"role": "generate", "model": "actor", "inputs": ["prompts"], "n": 4},
                "reward": {"role": "score", "fn": "digits", "inputs": ["rollout"]},
                "adv": {"role": "advantage", "inputs": ["reward"]},
                "train": {
                    "role": "update",
                    "model": "actor",
                    "inputs": ["rollout", "adv"],
                    "lr": 5e-4,
                },
            },
            "data": {"source": "builtin:digits", "batch_size": 4},
            "trainer": {"steps": 100, "seed": 1},
        }
    )
    # role, type and estimator are always shown; every other default is left out
    # (trainer.steps is 100, the default, so only seed remains).
    assert to_yaml(graph) == (
        "name: small\n"
        "models:\n"
        "  actor: {path: builtin:tiny-llama, device_group: cpus}\n"
        "devices:\n"
        "  cpus: {type: cpu}\n"
        "nodes:\n"
        "  rollout: {role: generate, model: actor, inputs: [prompts], n: 4}\n"
        "  reward:  {role: score, fn: digits, inputs: [rollout]}\n"
        "  adv:     {role: advantage, estimator: grpo, inputs: [reward]}\n"
        "  train:   {role: update, model: actor, inputs: [rollout, adv], lr: 0.0005}\n"
        "data: {source: builtin:digits, batch_size: 4}\n"
        "trainer: {seed: 1}\n"
    )


@pytest.mark.parametrize("path", PIPELINES, ids=lambda path: path.name)
def test_shipped_pipelines_round_trip(path: Path, tmp_path: Path) -> None:
    graph = load_pipeline(path)
    assert reload(to_yaml(graph), tmp_path) == graph
    assert to_yaml(graph.spec) == to_yaml(graph)


def test_awkward_values_round_trip(tmp_path: Path) -> None:
    graph = pipeline_from_dict(
        {
            "name": "yes",  # would read back as a boolean if written plain
            "models": {"actor": {"path": "dir with: colon/#x", "device_group": "g"}},
            "devices": {
                "g": {"type": "gpu", "count": 3, "arch": ["null", "1.5", "1e-5"]}
            },
            "nodes": {
                "rollout": {
                    "role": "generate",
                    "model": "actor",
                    "inputs": ["prompts"],
                    "top_p": 0.5,
                },
                "reward": {
                    "role": "score",
                    "fn": "pkg.mod:fn",
                    "inputs": ["rollout"],
                    "on_error": "strict",
                },
                "adv": {"role": "advantage", "inputs": ["reward"], "epsilon": 1e-8},
                "train": {
                    "role": "update",
                    "model": "actor",
                    "inputs": ["rollout", "adv"],
                    "betas": [0.5, 0.9],
                    "mini_batch_size": 2,
                },
            },
            "data": {"source": "data/my prompts.jsonl", "shuffle": False},
            "runtime": {"scheduler_address": "tcp://head:8786", "dashboard": True},
            "scheduler": {"policy": "dynamic", "low_util": 0.25},
        }
    )
    text = to_yaml(graph)
    assert "name: 'yes'" in text
    assert reload(text, tmp_path) == graph
