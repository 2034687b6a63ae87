"""When and how the driver evaluates: before training, every ``eval.every_steps`` and at the end.

The evaluation runs on the policy's generation worker (``Session.evaluate``), which applies
the reward functions; a score node's reward model scores the completions on its own worker
afterwards (``Session.score_held_out``), fetching them from the generation worker. Its metrics
join the step's line in ``metrics.jsonl`` (step 0 gets a line of its own), its timing goes
to ``profile.jsonl`` as the node ``eval``, and one ``eval`` event puts the numbers in the
live view and the plain log.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from flowrl.graph import PipelineGraph
from flowrl.records import EvalSettings, NodeTiming, RunEvent
from flowrl.runtime.calls import EvalCall
from flowrl.runtime.session import Session
from flowrl.spec.schema import GenerateNode, eval_score_nodes

EVAL_SEED_OFFSET = 1_000_003
"""Added to the run's seed for evaluation sampling, so it never mirrors training's stream."""


class Evaluator:
    def __init__(self, graph: PipelineGraph, examples: list[Any]) -> None:
        spec = graph.spec
        self.spec = spec.eval
        self.examples = tuple(examples)
        self.num_steps = spec.trainer.steps
        generate = graph.nodes_of(GenerateNode)[0]
        node = spec.nodes[generate]
        assert isinstance(node, GenerateNode)
        self.model = str(node.model)
        self.generate = node
        self.scorers: tuple[tuple[str, Any, dict[str, Any]], ...] = ()
        self.reward_models: tuple[str, ...] = ()
        """Score nodes whose reward model scores the held-out completions."""
        if self.spec is not None:
            nodes = eval_score_nodes(spec)
            self.scorers = tuple((name, item.fn, dict(item.params)) for name, item in nodes.items() if item.fn is not None)
            self.reward_models = tuple(name for name, item in nodes.items() if item.model is not None)
        self.seed = spec.trainer.seed + EVAL_SEED_OFFSET
        self.timeout_s = spec.runtime.node_timeout_s

    @property
    def enabled(self) -> bool:
        return self.spec is not None and bool(self.examples) and bool(self.scorers or self.reward_models)

    def due(self, step: int) -> bool:
        """Whether to evaluate after ``step`` (0: before the first update)."""
        if not self.enabled or self.spec is None:
            return False
        if step == 0:
            return self.spec.at_start
        return step % self.spec.every_steps == 0 or step == self.num_steps

    def settings(self) -> EvalSettings:
        assert self.spec is not None
        node = self.generate
        return EvalSettings(
            n=self.spec.n, temperature=self.spec.temperature,
            max_new_tokens=self.spec.max_new_tokens or node.max_new_tokens,
            top_p=node.top_p if self.spec.temperature > 0 else 1.0,
            top_k=node.top_k if self.spec.temperature > 0 else 0,
            engine=node.engine, batch_size=self.spec.batch_size, seed=self.seed,
        )

    def run(
        self, session: Session, step: int, on_event: Callable[[RunEvent], None]
    ) -> tuple[dict[str, float], list[NodeTiming]]:
        """Evaluate now; (metrics, the timing of each worker's part). A failure is a warning,
        not the end of the run: a lost worker is noticed and recovered by the next step."""
        started = time.perf_counter()
        call = EvalCall(step, self.model, self.examples, self.settings(), self.scorers, keep=bool(self.reward_models))
        try:
            reports = session.evaluate(call, self.timeout_s)
            scored = (session.score_held_out(step, self.reward_models, call.settings.n, len(self.examples),
                                             self.timeout_s) if self.reward_models else [])
        except Exception as error:  # noqa: BLE001 - evaluation never stops training
            on_event(RunEvent("warning", f"evaluation after step {step} failed: {type(error).__name__}: {error}", step))
            return {}, []
        metrics = merge_parts([report.metrics for report in reports])
        for report in scored:  # each over every held-out completion already
            metrics.update(report.metrics)
        generated = len(reports)
        reports = [*reports, *scored]
        # generation's rate counts the tokens it made; a reward model's, the tokens it read
        timings = [
            NodeTiming("eval", "eval", r.device, r.wall_s, r.compute_s, r.wait_s, r.tokens_in, r.tokens_out,
                       rate_of_output=index < generated)
            for index, r in enumerate(reports)
        ]
        on_event(RunEvent("eval", self.describe(step, metrics, time.perf_counter() - started), step, {"metrics": metrics}))
        for message in [message for report in reports for message in report.messages][:1]:
            on_event(RunEvent("warning", f"evaluation: {message}", step))
        return metrics, timings

    def describe(self, step: int, metrics: dict[str, float], seconds: float) -> str:
        assert self.spec is not None
        mode = "greedy" if self.spec.temperature == 0 else f"temperature {self.spec.temperature:g}"
        shown = ", ".join(
            f"{key} {value:.3f}" for key, value in metrics.items()
            if key.endswith(("/mean", f"/pass@{self.spec.n}")) and not key.startswith("val/response_length")
        )
        when = "before training" if step == 0 else f"after step {step}"
        took = f"{seconds:.1f} s" if seconds >= 0.1 else f"{seconds * 1000:.0f} ms"  # a small model's read 0.0 s
        return f"{when}: {shown} ({len(self.examples)} prompts x {self.spec.n}, {mode}, {took})"


def merge_parts(parts: list[dict[str, float]]) -> dict[str, float]:
    """The metrics of the whole evaluation from its parts': counts add up, and every mean or
    share is weighted by its part's number of prompts (each part has the same n, so prompts
    and completions weigh alike)."""
    if len(parts) == 1:
        return dict(parts[0])
    sizes = [float(max(1.0, part.get("val/num_prompts", 1.0))) for part in parts]
    total = sum(sizes)
    merged: dict[str, float] = {}
    for key in parts[0]:
        values = [part.get(key, 0.0) for part in parts]
        if key.rsplit("/", 1)[-1].startswith("num_"):
            merged[key] = sum(values)
        else:
            merged[key] = sum(value * size for value, size in zip(values, sizes)) / total
    return merged
