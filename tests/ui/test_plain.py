"""Exact lines of the plain log."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from flowrl.records import NodeTiming, RunEvent, StepRecord
from flowrl.ui.plain import PlainLog, format_step_line

if TYPE_CHECKING:
    from conftest import FakeClock, StepFactory


def test_step_line_matches_documented_format(clock: FakeClock, make_step: StepFactory) -> None:
    stream = io.StringIO()
    with PlainLog(stream, clock=clock) as log:
        log.on_step(make_step(11, elapsed_s=6.0))
        log.on_step(make_step(12, elapsed_s=6.084))
    # step 11 alone: 6.0 s / 11 steps = 0.5454 s/step, 109 left -> 59.45 s -> "59s"
    # steps 11 -> 12: 0.084 s/step, 108 left -> 9.072 s -> "9s"
    # nodes by compute time (gen's wall time is 31 ms, 2 ms of it waiting for its prompts)
    assert stream.getvalue().splitlines() == [
        "step 11/120 | reward 0.41 | resp_len 16.0 | step 0.084s | gen 29ms ref 5ms score 1ms "
        "update 38ms | 1,520 tok/s | eta 59s",
        "step 12/120 | reward 0.41 | resp_len 16.0 | step 0.084s | gen 29ms ref 5ms score 1ms "
        "update 38ms | 1,520 tok/s | eta 9s",
    ]


def test_last_step_has_no_time_left(clock: FakeClock, make_step: StepFactory) -> None:
    stream = io.StringIO()
    log = PlainLog(stream, clock=clock)
    log.on_step(make_step(120, elapsed_s=65.0, reward=0.9))
    assert stream.getvalue().endswith("| 1,520 tok/s | eta 0s\n")


def test_missing_metrics_are_left_out(clock: FakeClock) -> None:
    stream = io.StringIO()
    log = PlainLog(stream, clock=clock)
    log.on_step(StepRecord(step=2, num_steps=10, metrics={"critic/score/mean": 0.125},
                           elapsed_s=3.0))
    # 3.0 s / 2 steps = 1.5 s/step, 8 left -> 12 s
    assert stream.getvalue() == "step 2/10 | reward 0.12 | eta 12s\n"


def test_clock_stands_in_for_missing_elapsed(clock: FakeClock) -> None:
    stream = io.StringIO()
    log = PlainLog(stream, clock=clock)
    clock.advance(4.0)
    log.on_step(StepRecord(step=1, num_steps=16, metrics={}))
    # elapsed_s left at 0 -> 4 s by the clock; 4 s/step, 15 left -> 60 s
    assert stream.getvalue() == "step 1/16 | eta 1m00s\n"


def test_event_lines(clock: FakeClock) -> None:
    stream = io.StringIO()
    log = PlainLog(stream, clock=clock)
    log.on_event(RunEvent("placement", "gen, score -> cpu:0; ref -> cpu:1", step=0))
    log.on_event(RunEvent("checkpoint", "saved outputs/run/step-10", step=10))
    log.on_event(RunEvent("warning", "cpu:1 under 40% busy for 30s"))
    assert stream.getvalue().splitlines() == [
        "[event] placement: gen, score -> cpu:0; ref -> cpu:1",
        "[event] checkpoint: saved outputs/run/step-10",
        "[event] warning: cpu:1 under 40% busy for 30s",
    ]


def test_a_node_split_over_devices_shows_its_fastest_to_slowest_part(clock: FakeClock) -> None:
    def part(device: str, compute_s: float) -> NodeTiming:
        return NodeTiming("train", "update", device, wall_s=compute_s, compute_s=compute_s, wait_s=0.0,
                          tokens_in=10, tokens_out=0)

    record = StepRecord(step=1, num_steps=2, metrics={}, elapsed_s=1.0,
                        nodes=[part("cpu:0", 0.030), part("cpu:1", 0.0384),
                               NodeTiming("adv", "advantage", "cpu:0", wall_s=0.001, compute_s=0.0008,
                                          wait_s=0.0, tokens_in=0, tokens_out=0)])
    assert format_step_line(record, None) == "step 1/2 | train 30-38ms adv 0.8ms | eta -"


def test_with_several_score_nodes_the_failures_are_given_per_node() -> None:
    """A node failing on every sample beside a working one: 100 % by its name, not their 50 % mean."""
    metrics = {"reward/failed_share": 0.5, "reward/num_failed": 8.0, "reward/boom/failed_share": 1.0,
               "reward/boom/num_failed": 8.0, "reward/digits/failed_share": 0.0, "reward/digits/mean": 0.2}
    line = format_step_line(StepRecord(step=3, num_steps=9, metrics=metrics, elapsed_s=1.0, nodes=[]), None)
    assert "| boom failed 100% |" in line and "digits failed" not in line and "| failed 50%" not in line
    alone = format_step_line(StepRecord(step=3, num_steps=9, metrics={"reward/failed_share": 0.25},
                                        elapsed_s=1.0, nodes=[]), None)
    assert "| failed 25% |" in alone
