"""Calling a reward function without letting one bad sample end the run.

A reward function is user code: it can raise, return None or NaN for a sample it cannot
grade, or return the wrong number of scores. ``score_safely`` turns each of these into a
counted failure (``on_error="zero"``: the sample scores 0 and training goes on) or into one
RewardError naming the function and the first failing sample (``on_error="strict"``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

from flowrl.errors import RewardError

OnError = Literal["zero", "strict"]

_STRICT_HINT = (
    "fix the function, or set on_error: zero on the score node to score such samples 0 "
    "and count them in the metrics"
)


def _short(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def _as_score(value: Any) -> tuple[float | None, str]:
    """(score, "") for a usable value, else (None, why not)."""
    if value is None:
        return None, "returned None"
    try:
        score = float(value)
    except (TypeError, ValueError):
        return None, f"returned {type(value).__name__} {_short(str(value), 30)}, not a number"
    if not math.isfinite(score):
        return None, f"returned {score}"
    return score, ""


def _call(
    fn: Callable[..., Any],
    prompts: list[str],
    completions: list[str],
    answers: list[str | None],
    max_new_tokens: int,
) -> tuple[list[float | None], list[str], BaseException | None]:
    """Scores (None where unusable), the reason per failed sample, and the exception raised."""
    count = len(completions)
    try:
        result = fn(prompts, completions, answers, max_new_tokens)
    except Exception as error:
        return [None] * count, [f"raised {type(error).__name__}: {error}"] * count, error
    if isinstance(result, (str, bytes)) or not hasattr(result, "__len__"):
        why = f"returned {type(result).__name__}, not a list with one float per completion"
        return [None] * count, [why] * count, None
    if len(result) != count:
        why = f"returned {len(result)} scores for {count} completions"
        return [None] * count, [why] * count, None
    scores: list[float | None] = []
    reasons: list[str] = []
    for value in result:
        score, why = _as_score(value)
        scores.append(score)
        reasons.append(why)
    return scores, reasons, None


def score_safely(
    fn: Callable[..., Any],
    prompts: list[str],
    completions: list[str],
    answers: list[str | None],
    max_new_tokens: int,
    on_error: OnError = "zero",
    name: str | None = None,
) -> tuple[list[float], int]:
    """Call ``fn`` on the whole batch and return ``(scores, num_failed)``.

    When the batch call raises, each sample is scored alone so that only the samples that
    really fail are lost. A failed sample scores 0.0 under ``on_error="zero"``; under
    ``"strict"`` the first one raises RewardError with the function's ``name``, the sample's
    index, prompt and completion, and what went wrong.
    """
    if not len(prompts) == len(completions) == len(answers):
        raise ValueError(
            f"prompts ({len(prompts)}), completions ({len(completions)}) and answers "
            f"({len(answers)}) must have one entry per completion"
        )
    if on_error not in ("zero", "strict"):
        raise ValueError(f"on_error must be 'zero' or 'strict', got {on_error!r}")
    label = name or f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
    scores, reasons, batch_error = _call(fn, prompts, completions, answers, max_new_tokens)
    errors: list[BaseException | None] = [batch_error] * len(completions)
    if batch_error is not None and len(completions) > 1:
        for index in range(len(completions)):
            one = slice(index, index + 1)
            single, why, error = _call(
                fn, prompts[one], completions[one], answers[one], max_new_tokens
            )
            scores[index], reasons[index], errors[index] = single[0], why[0], error

    failed = [index for index, score in enumerate(scores) if score is None]
    if on_error == "strict":
        if failed:
            index = failed[0]
            raise RewardError(
                f"reward function '{label}' failed on sample {index} "
                f"(prompt {_short(prompts[index])}, completion {_short(completions[index])}): "
                f"{reasons[index]}; {len(failed)} of {len(scores)} samples failed; {_STRICT_HINT}"
            ) from errors[index]
        if batch_error is not None:
            raise RewardError(
                f"reward function '{label}' raised {type(batch_error).__name__}: {batch_error} "
                f"on the batch of {len(scores)}, though no single sample fails; {_STRICT_HINT}"
            ) from batch_error
    return [0.0 if score is None else score for score in scores], len(failed)
