"""An evaluation of a single data file without eval.source reads the training prompts
themselves; the run warns instead of calling them held out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flowrl.api.data import evaluates_training_prompts
from flowrl.spec.loader import pipeline_from_dict


def _pipeline(source: str, evaluation: dict[str, Any]) -> Any:
    return pipeline_from_dict({
        "name": "p",
        "models": {"actor": {"path": "builtin:tiny-llama"}},
        "nodes": {
            "rollout": {"role": "generate", "model": "actor", "inputs": ["prompts"]},
            "reward": {"role": "score", "fn": "digits", "inputs": ["rollout"]},
            "adv": {"role": "advantage", "inputs": ["reward"]},
            "train": {"role": "update", "model": "actor", "inputs": ["rollout", "adv"]},
        },
        "data": {"source": source},
        "eval": {"every_steps": 5, **evaluation},
    })


def test_only_a_single_file_without_an_eval_source_evaluates_on_its_training_prompts(tmp_path: Path) -> None:
    (tmp_path / "train.jsonl").write_text('{"prompt": "a"}\n')
    (tmp_path / "held.jsonl").write_text('{"prompt": "b"}\n')
    (tmp_path / "splits").mkdir()
    assert evaluates_training_prompts(_pipeline("train.jsonl", {}), tmp_path)
    assert evaluates_training_prompts(_pipeline("train.jsonl", {"source": "train.jsonl"}), tmp_path)
    assert not evaluates_training_prompts(_pipeline("train.jsonl", {"source": "held.jsonl"}), tmp_path)
    assert not evaluates_training_prompts(_pipeline("splits", {}), tmp_path)  # a folder: its test split
    assert not evaluates_training_prompts(_pipeline("builtin:digits", {}), tmp_path)
