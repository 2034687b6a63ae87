"""A job as users bring it: a datasets source, a held-out split, chats with a local model's
template, a reward function passed by value; resume after kill -9 stays exact."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoTokenizer

from flowrl.api.builder import Pipeline
from flowrl.api.run import run, validate
from flowrl.backends.builtin import builtin_model_dir
from flowrl.spec.loader import load_pipeline

pytestmark = pytest.mark.integration


def _lines(output: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (output / name).read_text().splitlines()]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-c", "from flowrl.cli.main import app; app()", *args]


def _pipeline(folder: Path, output: Path, with_eval: bool) -> Path:
    train = datasets.Dataset.from_dict({"prompt": [f"{'abcdefghij'[i]}q=" for i in range(10)], "level": list(range(10))})
    train.to_parquet(str(folder / "train.parquet"))
    datasets.Dataset.from_dict({"prompt": ["zz=", "yy=", "xx="]}).to_parquet(str(folder / "held_out.parquet"))
    p = Pipeline("datasets-resume")
    actor = p.model("actor", path="builtin:tiny-llama", group="actor_group")
    prompts = p.source("train.parquet", batch_size=4)  # 10 rows: batches cross epoch boundaries
    rollout = p.generate(actor, prompts, n=4, max_new_tokens=8)
    scores = p.score("digits", rollout)
    p.update(actor, rollout, p.advantage("grpo", scores), lr=5e-4)
    p.trainer(steps=7, output_dir=str(output), seed=0, checkpoint_every=3)
    data = p.to_dict()
    if with_eval:
        data["eval"] = {"source": "held_out.parquet", "every_steps": 3, "n": 2, "temperature": 1.0}
    path = folder / f"{output.name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_resume_after_kill_with_a_datasets_source_and_evaluation_is_exact(tmp_path: Path) -> None:
    # Reference: the same training without evaluation, never interrupted.
    whole = tmp_path / "whole"
    run(load_pipeline(_pipeline(tmp_path, whole, with_eval=False)), base_dir=tmp_path)

    killed = tmp_path / "killed"
    pipeline_file = _pipeline(tmp_path, killed, with_eval=True)
    process = subprocess.Popen(_cli("run", str(pipeline_file), "--plain"), start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while not (killed / "checkpoints" / "step-3" / "trainer_state.json").exists():
        assert process.poll() is None and time.monotonic() < deadline, "the run ended before its step-3 checkpoint"
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    resumed = subprocess.run(_cli("run", str(pipeline_file), "--plain", "--resume"), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr

    # every step once; evaluation before training, after steps 3 and 6, and after the last
    metrics = _lines(killed, "metrics.jsonl")
    assert [line["step"] for line in metrics] == list(range(0, 8))
    evaluated = [line["step"] for line in metrics if "val/reward/mean" in line]
    assert evaluated == [0, 3, 6, 7]
    assert all(f"val/reward/pass@2" in line for line in metrics if line["step"] in evaluated)
    assert sum(1 for e in _lines(killed, "profile.jsonl") if e.get("node") == "eval") >= 4
    # evaluation draws from its own RNG: the weights are those of the run without it
    expected = load_file(str(whole / "final" / "model.safetensors"))
    actual = load_file(str(killed / "final" / "model.safetensors"))
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=1e-6)

    # other rows in the file: the steps to come would draw other batches; refused, nothing trained
    datasets.Dataset.from_dict({"prompt": [f"{'abcdef'[i]}q=" for i in range(6)], "level": list(range(6))}).to_parquet(
        str(tmp_path / "train.parquet"))
    for _ in range(2):  # refused again: a refusal keeps the fingerprint of the steps trained
        changed = subprocess.run(_cli("run", str(pipeline_file), "--plain", "--resume", "trainer.steps=9"),
                                 capture_output=True, text=True)
        assert changed.returncode == 2, changed.stderr
        said = changed.stdout + changed.stderr
        assert "the training data differs from the data the run in" in said and "(10 rows then, 6 now)" in said
        assert "Traceback" not in said
    assert [line["step"] for line in _lines(killed, "metrics.jsonl")] == list(range(0, 8))


CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def has_a_digit(completions: list[list[dict[str, str]]], level: list[int], **kwargs: Any) -> list[float | None]:
    """A conversational TRL-style reward, passed to the builder by value; None on level 0."""
    return [None if lvl == 0 else float(any(ch.isdigit() for ch in c[0]["content"])) for c, lvl in zip(completions, level)]


def test_chat_prompts_a_local_model_folder_and_a_reward_function_by_value(tmp_path: Path) -> None:
    model = tmp_path / "my-model"
    shutil.copytree(builtin_model_dir("tiny-llama"), model)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(model))
    chats = [[{"role": "user", "content": f"{a}+{b}"}] for a, b in ((1, 2), (3, 4), (5, 6), (7, 8))]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": c, "level": i}) + "\n" for i, c in enumerate(chats)))

    p = Pipeline("chat")
    actor = p.model("actor", path=str(model))
    prompts = p.source("chat.jsonl", batch_size=4, prompt_key="messages", shuffle=False)
    rollout = p.generate(actor, prompts, n=2, max_new_tokens=6)
    scores = p.score(has_a_digit, rollout)
    p.update(actor, rollout, p.advantage("grpo", scores), lr=5e-4)
    p.trainer(steps=2, output_dir=str(tmp_path / "out"), seed=0)
    assert "fn: tests.integration.test_bring_your_own:has_a_digit" in p.to_yaml()
    result = run(p, base_dir=tmp_path)

    # "user: 1+2 assistant: " is 21 characters, one token each with the character tokenizer
    assert [record.metrics["prompt_length/mean"] for record in result.records] == [21.0, 21.0]
    # the level-0 chat's 2 samples (of 8) got None: not applicable, not failures
    assert [record.metrics["reward/num_none"] for record in result.records] == [2.0, 2.0]
    assert [record.metrics["reward/num_failed"] for record in result.records] == [0.0, 0.0]


def test_from_python_a_reward_module_named_by_string_is_read_from_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No pipeline file and no base_dir: data, models and reward modules are read from the
    working directory, by validate and by run alike."""
    (tmp_path / "cwd_rewards.py").write_text(
        "def length(completions, **kwargs):\n    return [float(len(c)) for c in completions]\n")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+{i}="}) + "\n" for i in range(4)))
    monkeypatch.chdir(tmp_path)
    p = Pipeline("cwd")
    actor = p.model("actor", path="builtin:tiny-llama")
    rollout = p.generate(actor, p.source("prompts.jsonl", batch_size=2), n=2, max_new_tokens=4)
    p.update(actor, rollout, p.advantage("grpo", p.score("cwd_rewards:length", rollout)))
    p.trainer(steps=1, output_dir="out", seed=0)
    validate(p)
    result = run(p)
    assert result.records[-1].metrics["reward/num_failed"] == 0.0
    assert result.records[-1].metrics["critic/score/mean"] > 0  # completions of 1 to 4 characters
