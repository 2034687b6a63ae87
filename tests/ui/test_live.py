"""The live view's text, rendered into a recording console with a fake clock."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from rich.console import Console

from flowrl.records import RunEvent
from flowrl.ui.live import NUM_EVENTS_SHOWN, LiveView

if TYPE_CHECKING:
    from conftest import FakeClock, StepFactory


@pytest.fixture
def console() -> Console:
    return Console(record=True, width=100, force_terminal=False, color_system=None)


def rendered(view: LiveView, console: Console) -> str:
    console.print(view.render())
    return console.export_text()


def row_cells(text: str, first_cell: str) -> list[str]:
    """The whitespace-split cells of the table row that starts with ``first_cell``."""
    rows = [line.split() for line in text.splitlines() if line.split()[:1] == [first_cell]]
    assert len(rows) == 1, f"expected one row for {first_cell!r} in:\n{text}"
    return rows[0]


def test_before_the_first_step(console: Console, clock: FakeClock) -> None:
    view = LiveView("grpo-digits", 120, console, clock=clock)
    clock.advance(2.0)
    text = rendered(view, console)
    assert "grpo-digits" in text
    assert "step 0/120" in text
    assert "elapsed 2s" in text
    assert "eta -" in text
    assert "waiting for the first step" in text


def test_header_tables_and_eta(
    console: Console, clock: FakeClock, make_step: StepFactory
) -> None:
    view = LiveView("grpo-digits", 120, console, clock=clock)
    view.on_step(make_step(11, elapsed_s=6.0, reward=0.0))
    view.on_step(make_step(12, elapsed_s=6.084, reward=0.41))
    text = rendered(view, console)

    assert "step 12/120" in text
    # steps 11 -> 12 took 0.084 s; 108 steps left -> 9.072 s
    assert "eta 9s" in text
    assert "elapsed 6s" in text
    # two rewards: the lower at the lowest block, the higher at the top
    assert "reward 0.41 ▁█" in text
    assert "resp_len 16.0" in text
    assert "step 0.084s" in text
    assert "1,520 tok/s" in text

    assert row_cells(text, "node") == ["node", "role", "device", "wall", "compute", "wait", "tok/s"]
    assert row_cells(text, "gen") == ["gen", "generate", "cpu:0", "31ms", "29ms", "2ms", "4,414"]
    assert row_cells(text, "ref") == ["ref", "reference_logprob", "cpu:1", "9ms", "5ms", "4ms", "76,800"]
    assert row_cells(text, "score") == ["score", "score", "cpu:0", "1ms", "1ms", "0ms", "128,000"]
    assert row_cells(text, "update") == ["update", "update", "cpu:0", "40ms", "38ms", "0.5ms", "10,105"]

    assert row_cells(text, "device") == ["device", "kind", "util", "memory"]
    assert row_cells(text, "cpu:0") == ["cpu:0", "cpu", "75%", "1.2", "GB"]
    assert row_cells(text, "cuda:1") == ["cuda:1", "gpu", "50%", "10.0", "/", "80.0", "GB"]


def test_elapsed_and_eta_move_between_steps(
    console: Console, clock: FakeClock, make_step: StepFactory
) -> None:
    view = LiveView("grpo-digits", 10, console, clock=clock)
    view.on_step(make_step(1, elapsed_s=5.0, num_steps=10))
    clock.advance(20.0)
    text = rendered(view, console)
    # elapsed: 5 s at the step + 20 s since = 25 s
    assert "elapsed 25s" in text
    # 5 s/step * 9 left = 45 s, of which 20 s have passed -> 25 s
    assert "eta 25s" in text


def test_elapsed_never_goes_back_when_the_first_step_comes(
    console: Console, clock: FakeClock, make_step: StepFactory
) -> None:
    """The run's clock starts after the cluster does: read alone, the view counted 0-3 s
    while it started, then 1 s at step 1."""
    view = LiveView("grpo-digits", 10, console, clock=clock)
    clock.advance(3.0)
    assert "elapsed 3s" in rendered(view, console)
    view.on_step(make_step(1, elapsed_s=1.0, num_steps=10))
    assert "elapsed 3s" in rendered(view, console)


def test_events_come_before_the_tables_that_a_short_terminal_cuts(
    console: Console, clock: FakeClock, make_step: StepFactory
) -> None:
    view = LiveView("grpo-digits", 10, console, clock=clock)
    view.on_step(make_step(3, elapsed_s=1.0, num_steps=10))
    view.on_event(RunEvent("fault", "worker cpu-1 lost", step=3))
    text = rendered(view, console)
    assert text.index("fault: worker cpu-1 lost") < text.index("compute") < text.index("util")


def test_long_runs_format_minutes(
    console: Console, clock: FakeClock, make_step: StepFactory
) -> None:
    view = LiveView("ppo", 300, console, clock=clock)
    view.on_step(make_step(50, elapsed_s=65.0, num_steps=300))
    text = rendered(view, console)
    # 65 s / 50 steps = 1.3 s/step, 250 left -> 325 s
    assert "step 50/300" in text
    assert "elapsed 1m05s" in text
    assert "eta 5m25s" in text


def test_recent_events_only(console: Console, clock: FakeClock) -> None:
    view = LiveView("grpo-digits", 120, console, clock=clock)
    view.on_event(RunEvent("placement", "gen, score, update -> cpu:0; ref -> cpu:1", step=0))
    for step in range(10, 10 * (NUM_EVENTS_SHOWN + 1), 10):
        view.on_event(RunEvent("checkpoint", f"saved outputs/run/step-{step}", step=step))
    view.on_event(RunEvent("warning", "cpu:1 under 40% busy for 30s"))
    text = rendered(view, console)
    # the placement and the first checkpoint fell out of the last NUM_EVENTS_SHOWN
    assert "placement" not in text
    assert "step-10" not in text
    assert "step 20  checkpoint: saved outputs/run/step-20" in text
    assert "step 50  checkpoint: saved outputs/run/step-50" in text
    assert "warning: cpu:1 under 40% busy for 30s" in text


def test_context_manager_leaves_final_state(
    console: Console, clock: FakeClock, make_step: StepFactory
) -> None:
    with LiveView("grpo-digits", 120, console, clock=clock) as view:
        view.on_step(make_step(120, elapsed_s=65.0))
    # A non-terminal console gets the final frame once, when the view stops.
    text = console.export_text()
    assert "step 120/120" in text
    assert "eta 0s" in text
    assert "update" in text


def test_failed_reward_samples_evaluations_and_the_last_warning_stay_in_view(
    clock: FakeClock, make_step: StepFactory
) -> None:
    from dataclasses import replace

    console = Console(record=True, width=160, force_terminal=False, color_system=None)  # one summary line
    view = LiveView("grpo-digits", 120, console, clock=clock)
    view.on_event(RunEvent("warning", "reward: 3 of 32 samples failed: ValueError: no number", step=7))
    view.on_event(RunEvent("eval", "500 held-out prompts", step=100,
                           data={"metrics": {"val/reward/mean": 0.356, "val/response_length/mean": 5.0}}))
    for step in range(101, 101 + NUM_EVENTS_SHOWN):
        view.on_event(RunEvent("checkpoint", f"saved step-{step}", step=step))
    record = make_step(104, elapsed_s=60.0)
    view.on_step(replace(record, metrics={**record.metrics, "reward/failed_share": 3 / 32, "reward/num_failed": 3.0}))
    text = rendered(view, console)
    assert "reward failed: 3 samples, 9%" in text
    # the evaluation's step is named; response lengths are not a score
    assert "eval@100 val/reward 0.356" in text and "val/response_length" not in text
    # the warning left the list of recent events and stays pinned under it
    assert "step 7  warning" not in text
    assert "last warning (step 7): reward: 3 of 32 samples failed: ValueError: no number" in text
