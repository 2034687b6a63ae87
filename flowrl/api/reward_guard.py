"""Reward functions that fail are loud: warned about at once, and fatal when they never work.

A reward function that raises on every sample scores 0 everywhere, and GRPO then trains on
nothing for as long as the run lasts. The guard warns the first step a score node's function
fails (and again when the error changes), and stops the run, with the function's first
error, once every sample of ``trainer.max_failed_reward_steps`` steps in a row failed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from flowrl.api.recovery import newest_written
from flowrl.errors import RewardError
from flowrl.graph import PipelineGraph
from flowrl.records import RunEvent
from flowrl.spec.schema import ScoreNode


class RewardFailureGuard:
    def __init__(self, graph: PipelineGraph, checkpoints: Path | None = None) -> None:
        self.limit = graph.spec.trainer.max_failed_reward_steps
        self.functions = {
            name: str(node.fn_name)
            for name, node in graph.spec.nodes.items()
            if isinstance(node, ScoreNode) and node.fn is not None
        }
        self.streaks = {name: 0 for name in self.functions}
        self.first_errors: dict[str, str] = {}
        self._warned: dict[str, str] = {}
        self.checkpoints = checkpoints

    def check(self, step: int, reports: dict[str, Any], on_event: Callable[[RunEvent], None]) -> None:
        """Look at one step's score reports; raises RewardError when a function never works."""
        for name, function in self.functions.items():
            report = reports.get(name)
            if report is None:
                continue
            share = float(report.metrics.get("reward/failed_share", 0.0))
            message = report.messages[0] if report.messages else None
            if share > 0 and message and self._warned.get(name) != message.split(" (prompt")[0]:
                self._warned[name] = message.split(" (prompt")[0]
                on_event(RunEvent("warning", f"score node '{name}': {share:.0%} of samples failed: {message}", step))
            if share >= 1.0:
                if self.streaks[name] == 0 and message:
                    self.first_errors[name] = message
                self.streaks[name] += 1
            else:
                self.streaks[name] = 0
            if self.streaks[name] >= self.limit:
                signal = "its reward gave training no signal" if len(self.functions) > 1 else "training had no signal"
                raise RewardError(
                    f"the reward function '{function}' of score node '{name}' failed on every sample for "
                    f"{self.limit} steps in a row (trainer.max_failed_reward_steps), so {signal}; the run "
                    f"stopped at step {step}{self._kept()}. First error: {self.first_errors.get(name, 'unknown')}"
                )

    def _kept(self) -> str:
        if self.checkpoints is None or (written := newest_written(self.checkpoints)) is None:
            return ""
        return f"; its newest checkpoint is {written} (fix the function, then `flowrl resume {self.checkpoints.parent}`)"
