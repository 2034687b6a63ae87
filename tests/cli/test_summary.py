"""The reward line `flowrl run` prints at the end."""

from __future__ import annotations

from types import SimpleNamespace

from flowrl.cli.main import _reward_summary


def _records(steps: range, values: list[float]) -> list[SimpleNamespace]:
    return [SimpleNamespace(step=step, metrics={"critic/score/mean": value}) for step, value in zip(steps, values)]


def test_the_reward_line_averages_the_first_and_last_steps_and_names_single_ones() -> None:
    # 3 steps: a window of one step each side, named by its step
    assert _reward_summary(_records(range(1, 4), [0.25, 0.5, 0.75])) == "reward mean: step 1 0.250 -> step 3 0.750"
    # 4 steps: two each side, (0 + 0.5) / 2 and (0.5 + 1) / 2
    assert _reward_summary(_records(range(1, 5), [0.0, 0.5, 0.5, 1.0])) == \
        "reward mean: first 2 steps 0.250 -> last 2 steps 0.750"
    # resumed after step 10: the steps by number
    assert _reward_summary(_records(range(11, 13), [0.5, 1.0])) == \
        "reward mean since the resume: step 11 0.500 -> step 12 1.000"
    assert _reward_summary(_records(range(1, 2), [0.5])) == "reward mean: step 1 0.500"
    assert _reward_summary(_records(range(7, 8), [0.5])) == "reward mean since the resume: step 7 0.500"
    assert _reward_summary([]) == ""
