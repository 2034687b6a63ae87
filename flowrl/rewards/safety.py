"""Calling a reward function without letting one bad sample end the run.

A reward function is user code: it can raise, return NaN or something that is not a number,
or return the wrong number of scores. ``score_safely`` turns each of these into a counted
failure (``on_error="zero"``: the sample scores 0 and training goes on) or into one
RewardError naming the function and the first failing sample (``on_error="strict"``).
None for a sample means what it means to TRL: the function does not apply to it; the
sample scores 0 from this function and is counted apart (``num_none``), not as a failure.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Literal

from flowrl.errors import RewardError
from flowrl.rewards.calling import RewardInputs, call_reward

OnError = Literal["zero", "strict"]

NOT_APPLICABLE = "returned None"

BATCH_FAILED = "the call of reward function"
"""How the message of a batch call that raised begins (``ScoreResult.batch_error``)."""

_STRICT_HINT = (
    "fix the function, or set on_error: zero on the score node to score such samples 0 "
    "and count them in the metrics"
)


def _short(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def _as_score(value: Any) -> tuple[float | None, str]:
    """(score, "") for a usable value, else (None, why not)."""
    if value is None:  # TRL's "not applicable to this sample": scores 0, not a failure
        return 0.0, NOT_APPLICABLE
    if isinstance(value, (str, bytes)):  # float() would read "1.0": text is never a score
        return None, f"returned {type(value).__name__} {_short(str(value), 30)}, not a number"
    try:
        score = float(value)
    except (TypeError, ValueError):
        return None, f"returned {type(value).__name__} {_short(str(value), 30)}, not a number"
    if not math.isfinite(score):
        return None, f"returned {score}"
    return score, ""


def _where(fn: Callable[..., Any], error: BaseException) -> str:
    """`` at FILE:LINE (source)`` of the frame that raised: the deepest one in the reward
    function's own file, else the deepest outside flowrl; empty when none is known."""
    frames = traceback.extract_tb(error.__traceback__)
    own = getattr(getattr(fn, "__code__", None), "co_filename", None)
    package = Path(__file__).resolve().parents[1]
    mine = [frame for frame in frames if own is not None and frame.filename == own]
    outside = [frame for frame in frames if not Path(frame.filename).resolve().is_relative_to(package)]
    found = mine or outside
    if not found:
        return ""
    chosen = found[-1]
    source = f" ({chosen.line.strip()})" if chosen.line else ""
    return f" at {Path(chosen.filename).name}:{chosen.lineno}{source}"


def _call(
    fn: Callable[..., Any], inputs: RewardInputs, params: dict[str, Any]
) -> tuple[list[float | None], list[str], BaseException | None, str | None]:
    """Scores (None where unusable), the reason per failed sample, the exception raised, and
    why the whole call's result is unusable (not a list of the batch's length), if it is."""
    count = len(inputs)
    try:
        result = call_reward(fn, inputs, params)
    except Exception as error:
        return [None] * count, [f"raised {type(error).__name__}: {error}{_where(fn, error)}"] * count, error, None
    if isinstance(result, (str, bytes, Mapping, AbstractSet)) or not hasattr(result, "__len__"):
        # a mapping or set has a length, but no order that pairs its items with the completions
        why = f"returned {type(result).__name__}, not a list with one float per completion"
        return [None] * count, [why] * count, None, why
    if len(result) != count:
        why = f"returned {len(result)} scores for {count} completions"
        return [None] * count, [why] * count, None, why
    scores: list[float | None] = []
    reasons: list[str] = []
    for value in result:
        score, why = _as_score(value)
        scores.append(score)
        reasons.append(why)
    return scores, reasons, None, None


@dataclass(frozen=True)
class ScoreResult:
    """What one call of a reward function on a batch gave."""

    scores: list[float]
    """One score per sample; 0.0 for a failed one."""
    num_failed: int
    """Samples that raised or returned something that is not a finite number."""
    num_none: int = 0
    """Samples the function returned None for (not applicable; scored 0)."""
    first_error: str | None = None
    """What went wrong with the first failed sample, with the sample shown (None: none failed)."""
    batch_error: str | None = None
    """What the call on the whole batch raised, when it did and each sample was then scored
    alone (None: the batch call worked)."""


def score_safely(
    fn: Callable[..., Any],
    inputs: RewardInputs,
    params: dict[str, Any] | None = None,
    on_error: OnError = "zero",
    name: str | None = None,
) -> ScoreResult:
    """Call ``fn`` on the whole batch (see :func:`flowrl.rewards.calling.call_reward`).

    When the batch call raises, each sample is scored alone so that only the samples that
    really fail are lost (one call per sample; ``batch_error`` says so: a function that
    normalises over its batch or calls a judge once per batch sees batches of one then). A
    failed sample scores 0.0 under ``on_error="zero"``; under ``"strict"`` the first one
    raises RewardError with the function's ``name``, the sample's index, prompt and
    completion, and what went wrong.
    """
    if on_error not in ("zero", "strict"):
        raise ValueError(f"on_error must be 'zero' or 'strict', got {on_error!r}")
    params = params or {}
    label = name or f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
    scores, reasons, batch_error, unusable = _call(fn, inputs, params)
    errors: list[BaseException | None] = [batch_error] * len(inputs)
    if batch_error is not None and len(inputs) > 1:
        for index in range(len(inputs)):
            single, why, error, _ = _call(fn, inputs.row(index), params)
            scores[index], reasons[index], errors[index] = single[0], why[0], error

    failed = [index for index, score in enumerate(scores) if score is None]
    first_error = None
    if unusable is not None:  # the call's result as a whole, not one sample, is wrong
        batch = f"{len(scores)} completion{'s' if len(scores) != 1 else ''}"
        first_error = (f"reward function '{label}' {unusable} (called on a batch of {batch}); "
                       f"{len(failed)} of {len(scores)} samples failed")
    elif failed:
        index = failed[0]
        first_error = (
            f"reward function '{label}' failed on sample {index} (prompt {_short(str(inputs.prompts[index]))}, "
            f"completion {_short(str(inputs.completions[index]))}): {reasons[index]}; "
            f"{len(failed)} of {len(scores)} samples failed"
        )
    if on_error == "strict":
        if failed:
            raise RewardError(f"{first_error}; {_STRICT_HINT}") from errors[failed[0]]
        if batch_error is not None:
            raise RewardError(
                f"reward function '{label}' raised {type(batch_error).__name__}: {batch_error} "
                f"on the batch of {len(scores)}, though no single sample fails; {_STRICT_HINT}"
            ) from batch_error
    num_none = sum(why == NOT_APPLICABLE for why in reasons)
    fallback = None
    if batch_error is not None and len(inputs) > 1:
        fallback = (f"{BATCH_FAILED} '{label}' on the batch of {len(scores)} raised {type(batch_error).__name__}: "
                    f"{batch_error}{_where(fn, batch_error)}; each sample was scored alone ({len(scores)} calls)")
    return ScoreResult([0.0 if score is None else score for score in scores], len(failed), num_none=num_none,
                       first_error=first_error, batch_error=fallback)
