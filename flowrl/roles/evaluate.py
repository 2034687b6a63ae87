"""Held-out evaluation: generate for held-out prompts with the current policy, then score.

Runs on a worker that holds the policy (the generate node's), between two steps. Sampling
draws from its own generator, seeded by the evaluation's seed, so evaluating never moves
the training run's sampling stream: a run with evaluation trains exactly like one without.

A score node with a reward model scores on the worker that holds that model
(:func:`score_held_out`, from the completions this one keeps). For each score node ``s``::

    val/<s>/mean        mean score over every completion (mean@n when n > 1)
    val/<s>/pass@<n>    share of prompts with at least one completion scoring above 0 (n > 1;
                        reward functions only)
    val/<s>/num_failed  samples the function failed on (0 for a reward model)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from flowrl.rewards import score_safely
from flowrl.roles.batch import NodeOutput
from flowrl.roles.generate import run_generate
from flowrl.roles.reward_model import run_reward_model
from flowrl.roles.score import reward_inputs
from flowrl.records import EvalSettings
from flowrl.roles.state import ModelState


@dataclass(frozen=True)
class EvalScorer:
    """One score node's reward function, as evaluation applies it (weight not applied)."""

    node: str
    fn: Callable[..., Any]
    name: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class _Sampling:
    """The generate-node fields ``run_generate`` reads."""

    n: int
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    engine: str


def run_evaluation(
    state: ModelState, examples: Sequence[Any], settings: EvalSettings, scorers: Sequence[EvalScorer],
    keep: bool = False,
) -> NodeOutput:
    """Every scorer's metrics over ``examples`` (see the module docstring); with ``keep`` its
    value is the list of rollouts generated (one per chunk), for reward models to score
    (:func:`score_held_out`)."""
    greedy = settings.temperature == 0
    sampling = _Sampling(
        settings.n, settings.max_new_tokens, 1.0 if greedy else settings.temperature,
        settings.top_p, settings.top_k, settings.engine,
    )
    generator = torch.Generator(device=state.device)
    generator.manual_seed(settings.seed)
    scores: dict[str, list[float]] = {scorer.node: [] for scorer in scorers}
    failed = {scorer.node: 0 for scorer in scorers}
    errors: list[str] = []
    lengths: list[float] = []
    rollouts: list[Any] = []
    tokens_in = tokens_out = 0
    for start in range(0, len(examples), settings.batch_size):
        chunk = examples[start:start + settings.batch_size]
        rollout = run_generate(state, chunk, sampling, generator=generator, greedy=greedy).value
        tokens_in += rollout.num_prompt_tokens
        tokens_out += rollout.num_completion_tokens
        lengths.extend(rollout.completion_mask.sum(dim=1).float().tolist())
        if keep:
            rollouts.append(rollout)
        inputs = reward_inputs(rollout)
        for scorer in scorers:
            result = score_safely(scorer.fn, inputs, scorer.params, on_error="zero", name=scorer.name)
            scores[scorer.node].extend(result.scores)
            failed[scorer.node] += result.num_failed
            if result.first_error and not errors:
                errors.append(result.first_error)
    metrics: dict[str, float] = {
        "val/num_prompts": float(len(examples)),
        "val/response_length/mean": sum(lengths) / max(1, len(lengths)),
    }
    for node, values in scores.items():
        metrics.update(_score_metrics(node, values, settings.n))
        metrics[f"val/{node}/num_failed"] = float(failed[node])
    return NodeOutput(value=rollouts if keep else None, metrics=metrics, tokens_in=tokens_in, tokens_out=tokens_out,
                      messages=tuple(errors))


def score_held_out(state: ModelState, node: str, rollouts: Sequence[Any], n: int,
                   micro_batch_tokens: int | None, retokenize: bool = False) -> NodeOutput:
    """A reward model's ``val/<node>/*`` over an evaluation's completions (``rollouts`` in
    prompt order), as a reward function's (its weight not applied)."""
    values: list[float] = []
    tokens_in = 0
    for rollout in rollouts:
        scores = run_reward_model(state, rollout, 1.0, micro_batch_tokens, retokenize)
        values.extend(scores.value.values.tolist())
        tokens_in += scores.tokens_in
    # no pass@n: "a completion scoring above 0" is a verdict for a checker's scores, not for a
    # reward model's scale
    metrics = _score_metrics(node, values, n, pass_at=False)
    metrics[f"val/{node}/num_failed"] = 0.0
    return NodeOutput(value=None, metrics=metrics, tokens_in=tokens_in)


def _score_metrics(node: str, values: list[float], n: int, pass_at: bool = True) -> dict[str, float]:
    """Mean over completions; with n > 1 also mean@n and (``pass_at``) pass@n over the
    prompts' groups (a prompt's n completions are consecutive)."""
    metrics = {f"val/{node}/mean": sum(values) / max(1, len(values))}
    if n > 1:
        metrics[f"val/{node}/mean@{n}"] = metrics[f"val/{node}/mean"]
    if n > 1 and pass_at:
        groups = [values[start:start + n] for start in range(0, len(values), n)]
        metrics[f"val/{node}/pass@{n}"] = sum(any(value > 0 for value in group) for group in groups) / max(1, len(groups))
    return metrics
