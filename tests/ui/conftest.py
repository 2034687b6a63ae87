"""Shared records and a fake clock for the UI tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from flowrl.records import DeviceSample, NodeTiming, StepRecord


class FakeClock:
    """A clock that moves only when the test says so."""

    def __init__(self, now_s: float = 100.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


StepFactory = Callable[..., StepRecord]


@pytest.fixture
def make_step() -> StepFactory:
    """Builds a GRPO step record: ``make_step(step, elapsed_s, reward=0.41, num_steps=120)``."""
    return _make_step


def _make_step(
    step: int, elapsed_s: float, reward: float = 0.41, num_steps: int = 120
) -> StepRecord:
    """A GRPO step with four nodes on two devices."""
    return StepRecord(
        step=step,
        num_steps=num_steps,
        metrics={
            "critic/score/mean": reward,
            "response_length/mean": 16.0,
            "timing_s/step": 0.084,
            "perf/throughput": 1520.4,
        },
        nodes=[
            # tok/s: generated tokens / compute for gen (128 / 0.029 s = 4,414), tokens
            # read / compute elsewhere (384 / 0.005 = 76,800; 128 / 0.001; 384 / 0.038 = 10,105)
            NodeTiming("gen", "generate", "cpu:0", wall_s=0.031, compute_s=0.029, wait_s=0.002,
                       tokens_in=256, tokens_out=128, rate_of_output=True),
            NodeTiming("ref", "reference_logprob", "cpu:1", wall_s=0.009, compute_s=0.005,
                       wait_s=0.004, tokens_in=384, tokens_out=128),
            NodeTiming("score", "score", "cpu:0", wall_s=0.001, compute_s=0.001, wait_s=0.0,
                       tokens_in=128, tokens_out=0),
            NodeTiming("update", "update", "cpu:0", wall_s=0.040, compute_s=0.038, wait_s=0.0005,
                       tokens_in=384, tokens_out=0),
        ],
        devices=[
            DeviceSample("cpu:0", "cpu", utilization=0.75, memory_gb=1.234),
            DeviceSample("cuda:1", "gpu", utilization=0.5, memory_gb=10.0, memory_total_gb=80.0),
        ],
        elapsed_s=elapsed_s,
    )
