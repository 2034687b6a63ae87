"""Reward functions that fail are loud: warned about at once, and fatal when they never work.

A reward function that raises on every sample scores 0 everywhere, and GRPO then trains on
nothing for as long as the run lasts. The guard warns the first step a score node's function
fails (and again when the error changes), and stops the run, with the function's first
error, once every sample of ``trainer.max_failed_reward_steps`` steps in a row failed.

A function that returns None (does not apply) for every sample of a step is warned about
the first time. When its score node is the pipeline's only one, every sample of
``max_failed_reward_steps`` steps in a row failed or without a score stops the run too: the
scores are all 0 and training has no signal. Beside other score nodes (functions or reward
models) it may rightly not apply to a whole batch (a task the batch does not hold), and only
the warning is given. A score node no advantage reads only watches: its failures are warned
about and never stop the run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from flowrl.api.recovery import resume_note
from flowrl.errors import RewardError
from flowrl.graph import PipelineGraph, trained_scores
from flowrl.records import RunEvent
from flowrl.rewards.safety import BATCH_FAILED
from flowrl.spec.schema import ScoreNode


class RewardFailureGuard:
    def __init__(self, graph: PipelineGraph, checkpoints: Path | None = None) -> None:
        self.limit = graph.spec.trainer.max_failed_reward_steps
        self.functions = {
            name: str(node.fn_name)
            for name, node in graph.spec.nodes.items()
            if isinstance(node, ScoreNode) and node.fn is not None
        }
        # a reward model's score node gives signal too: a function is alone only without one;
        # a score node no advantage reads gives none, and failing there stops nothing
        self.trained = trained_scores(graph.spec)
        self.alone = len(self.trained) == 1
        self.streaks = {name: 0 for name in self.functions}
        self.first_errors: dict[str, str] = {}
        self._warned: dict[str, str] = {}
        self._warned_none: set[str] = set()
        self._warned_batch: set[str] = set()
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
            batch = next((line for line in report.messages if line.startswith(BATCH_FAILED)), None)
            if batch is not None and name not in self._warned_batch:
                self._warned_batch.add(name)  # once: it recurs every step a batch call fails
                on_event(RunEvent("warning", f"score node '{name}': {batch} (reward/batch_failed counts the steps "
                                             "it happened; a function that normalises over its batch or calls a "
                                             "judge once per batch saw batches of one)", step))
            none = float(report.metrics.get("reward/none_share", 0.0))
            if none >= 1.0 and name not in self._warned_none:
                self._warned_none.add(name)
                on_event(RunEvent("warning", f"score node '{name}': the reward function '{function}' returned None "
                                             "(does not apply) for every sample of this step, which all score 0 from "
                                             "it; if it should apply, make it return a number per completion", step))
            if name not in self.trained:
                continue  # only watches: warned about above, and training does not depend on it
            alone = self.alone
            if share >= 1.0 or (alone and share + none >= 1.0):
                if self.streaks[name] == 0 and message:
                    self.first_errors[name] = message
                self.streaks[name] += 1
            else:
                self.streaks[name] = 0
            if self.streaks[name] >= self.limit:
                signal = "training had no signal" if alone else "its reward gave training no signal"
                what = "failed on every sample" if share >= 1.0 else "failed or returned None on every sample"
                first = self.first_errors.get(name, "it returned None for every sample" if share < 1.0 else "unknown")
                raise RewardError(
                    f"the reward function '{function}' of score node '{name}' {what} for "
                    f"{self.limit} steps in a row (trainer.max_failed_reward_steps), so {signal}; the run "
                    f"stopped at step {step}{self._kept()}. First error: {first}"
                )

    def _kept(self) -> str:
        return resume_note(self.checkpoints, "fix the function")
