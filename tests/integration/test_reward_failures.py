"""A reward function that fails on every sample stops the run, loudly, after the set steps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.rewards.test_trl_convention import _pipeline

FLOWRL = str(Path(sys.executable).parent / "flowrl")

pytestmark = pytest.mark.integration


def test_a_reward_failing_on_every_sample_stops_the_run(tmp_path: Path) -> None:
    # Written for flowrl's old positional convention: every keyword call raises TypeError.
    path = _pipeline(
        tmp_path, "def old_style(prompts, completions, answers=None, max_new_tokens=4):\n    return answers[0]\n",
        "my_rewards:old_style", max_failed_reward_steps=2,
    )
    result = subprocess.run([FLOWRL, "run", str(path), "--plain"], capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output
    # the first failing step warns at once, with the error and the sample
    assert "[event] warning: score node 'reward': 100% of samples failed: reward function " \
           "'my_rewards:old_style' failed on sample 0" in result.stdout
    assert "TypeError: 'NoneType' object is not subscriptable at my_rewards.py:2 (return answers[0])" in result.stdout
    # the status line shows the failed share
    assert "failed 100%" in result.stdout
    # and after 2 such steps the run stops with the first error
    message = " ".join(result.stderr.split())
    assert "failed on every sample for 2 steps in a row (trainer.max_failed_reward_steps)" in message
    assert "First error: reward function 'my_rewards:old_style' failed on sample 0" in message
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    assert json.loads(lines[-1])["reward/failed_share"] == 1.0
