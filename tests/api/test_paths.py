"""The run's copy of its pipeline names local models, data and reward modules absolutely, so
it loads and validates from any folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.api.checks import check_inputs
from flowrl.api.paths import absolute_paths
from flowrl.backends.builtin import builtin_model_dir
from flowrl.spec.dump import to_yaml
from flowrl.spec.loader import load_pipeline, pipeline_from_dict


def test_relative_paths_found_next_to_the_pipeline_become_absolute_and_the_copy_validates_elsewhere(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    project = tmp_path / "project"
    (project / "rewards").mkdir(parents=True)
    builtin_model_dir("tiny-llama", tmp_path / "cache").rename(project / "policy")
    (project / "train.jsonl").write_text('{"prompt": "ab=", "answer": "1"}\n{"prompt": "cd=", "answer": "2"}\n')
    (project / "my_rewards.py").write_text("def correct(completions, **kwargs):\n    return [0.0] * len(completions)\n")
    (project / "rewards" / "shape.py").write_text("def short(completions, **kwargs):\n    return [0.0] * len(completions)\n")
    graph = pipeline_from_dict({
        "name": "own",
        "models": {"actor": {"path": "policy"}, "reference": {"path": "builtin:tiny-llama"}},
        "nodes": {
            "rollout": {"role": "generate", "model": "actor", "inputs": ["prompts"], "n": 2},
            "reward": {"role": "score", "fn": "my_rewards:correct", "inputs": ["rollout"]},
            "shaping": {"role": "score", "fn": "rewards/shape.py:short", "inputs": ["rollout"]},
            "digits": {"role": "score", "fn": "digits", "inputs": ["rollout"]},
            "ref": {"role": "reference_logprob", "model": "reference", "inputs": ["rollout"]},
            "adv": {"role": "advantage", "inputs": ["reward", "shaping", "digits"]},
            "train": {"role": "update", "model": "actor", "inputs": ["rollout", "adv", "ref"], "kl_coef": 0.1},
        },
        "data": {"source": "train.jsonl", "batch_size": 2},
    })
    fixed = absolute_paths(graph, project)
    assert fixed.spec.models["actor"].path == str((project / "policy").resolve())
    assert fixed.spec.models["reference"].path == "builtin:tiny-llama"
    assert fixed.spec.data.source == str((project / "train.jsonl").resolve())
    nodes = fixed.spec.nodes
    assert nodes["reward"].fn == f"{(project / 'my_rewards.py').resolve()}:correct"  # type: ignore[union-attr]
    assert nodes["shaping"].fn == f"{(project / 'rewards' / 'shape.py').resolve()}:short"  # type: ignore[union-attr]
    assert nodes["digits"].fn == "digits"  # type: ignore[union-attr]
    assert absolute_paths(fixed, project) is fixed  # nothing left to change

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "config.yaml").write_text(to_yaml(fixed))
    monkeypatch.chdir(elsewhere)
    copy = load_pipeline(elsewhere / "config.yaml")
    check_inputs(copy, elsewhere)  # models, data and reward functions all found from here
    assert copy == fixed
