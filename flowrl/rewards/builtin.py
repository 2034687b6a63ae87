"""Rule-based reward functions shipped with flowrl, and their registry.

Every reward function is called the way TRL calls one: with keyword arguments ``prompts``,
``completions``, ``completion_ids``, every dataset column by its name (the reference answer
also as ``answer``), flowrl's ``max_new_tokens`` and the score node's ``params``; it returns
one float (or None: not gradable) per completion. A function takes what it needs and ends
with ``**kwargs`` for the rest. With chat data a completion is a list holding one assistant
message; the functions here read its text through :func:`completion_text`.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any, Callable

RewardFunction = Callable[..., list[float | None]]
"""``fn(*, prompts, completions, completion_ids, <columns>, max_new_tokens, **params)``."""

DIGIT_CHARACTERS = frozenset("0123456789")

FORMAT_PATTERN = r"^<think>.*?</think>\s*<answer>.*?</answer>$"
"""regex_format's default: reasoning in ``<think>`` then the answer in ``<answer>`` tags."""


def completion_text(completion: Any) -> str:
    """The text of a completion: itself, or the content of a chat completion's last message."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


def digit_match(completions: list[Any], max_new_tokens: int, **kwargs: Any) -> list[float | None]:
    """Share of the completion that is ASCII digits: ``digits / max_new_tokens``, in [0, 1].

    Dense from a random-init model (about 1 character in 8 of the built-in character
    vocabulary is a digit), so GRPO groups almost always differ; 1.0 is a completion of only
    digits that uses the whole token budget.
    """
    limit = max(max_new_tokens, 1)
    return [
        min(1.0, sum(char in DIGIT_CHARACTERS for char in completion_text(completion)) / limit)
        for completion in completions
    ]


def first_letter_match(
    prompts: list[Any], completions: list[Any], max_new_tokens: int, answer: list[Any] | None = None, **kwargs: Any
) -> list[float | None]:
    """Reward for repeating the prompt's first letter: half presence, half leading run.

    With ``target`` = the answer (or, when there is none, the prompt's first character) and
    ``head`` = the first ``max_new_tokens`` characters of the completion::

        reward = 0.5 * (characters of head that are target) / max_new_tokens
               + 0.5 * (length of the run of target at the start of head) / max_new_tokens

    (counted in characters: with a character-level tokenizer one token is one character).

    The first half gives partial credit for the letter anywhere, which a random-init model
    produces by chance often enough (1 character in ~80 of the built-in character
    vocabulary, so a group of 8 x 16 characters usually holds a hit) for GRPO groups to
    differ; the second half is the task itself and pulls the letter to the front. A
    completion of ``target`` repeated ``max_new_tokens`` times scores 1.0; without any
    ``target`` it scores 0.0.
    """
    limit = max(max_new_tokens, 1)
    answers = answer if answer is not None else [None] * len(completions)
    scores: list[float | None] = []
    for prompt, completion, expected in zip(prompts, completions, answers):
        target = str(expected) if expected else completion_text(prompt)[:1]
        head = completion_text(completion)[:limit]
        if not target:
            scores.append(0.0)
            continue
        present_chars = head.count(target) * len(target)
        repeats = 0
        while head.startswith(target * (repeats + 1)):
            repeats += 1
        run_chars = repeats * len(target)
        scores.append(0.5 * present_chars / limit + 0.5 * run_chars / limit)
    return scores


def _require_answer(expected: Any) -> None:
    if expected is None or not str(expected).strip():
        raise ValueError(
            "this sample has no reference answer; give every row of the data a value in the "
            "answer column (data.answer_key; for held-out prompts eval.answer_key)"
        )


def exact_match(completions: list[Any], answer: list[Any], **kwargs: Any) -> list[float | None]:
    """1.0 when the stripped completion starts with the stripped answer, else 0.0.

    "starts with" rather than "equals" because generation runs to ``max_new_tokens`` and a
    correct answer is often followed by more text. A sample without a reference answer
    raises (a failed sample, counted and reported), so missing answers never pass silently.
    """
    scores: list[float | None] = []
    for completion, expected in zip(completions, answer):
        _require_answer(expected)
        scores.append(1.0 if completion_text(completion).strip().startswith(str(expected).strip()) else 0.0)
    return scores


_BOXED = re.compile(r"\\boxed\s*\{")
_HASHES = re.compile(r"####\s*([^\n]+)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def _boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, braces balanced."""
    starts = [match.end() for match in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for position in range(start, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[start:position]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a solution: ``\\boxed{...}``, else after ``####``, else its last number."""
    boxed = _boxed(text)
    if boxed is not None:
        return boxed
    hashes = _HASHES.findall(text)
    if hashes:
        return str(hashes[-1])
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalize_answer(text: str) -> str | Fraction:
    """An answer in a comparable form: a number as an exact Fraction (``1,000``, ``1000.0``
    and ``$1000`` are equal; ``0.5`` equals ``1/2``), anything else as lower-case text
    without spaces, ``$`` and a trailing period."""
    cleaned = text.strip().strip("$").replace("\\$", "").replace(",", "").replace(" ", "").rstrip(".")
    cleaned = re.sub(r"^\\text\{(.*)\}$", r"\1", cleaned)
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return cleaned.lower()


def math_answer(completions: list[Any], answer: list[Any], **kwargs: Any) -> list[float | None]:
    """1.0 when the completion's final answer equals the reference answer, else 0.0.

    The final answer is found as :func:`extract_answer` says (``\\boxed{}``, ``#### x``, or the
    last number) in the completion, and in the reference too when it is a full solution (a
    GSM8K answer ends in ``#### 72``); both are compared after :func:`normalize_answer`. A
    completion with no answer in it scores 0.0; a sample without a reference answer raises.
    """
    scores: list[float | None] = []
    for completion, expected in zip(completions, answer):
        _require_answer(expected)
        reference = extract_answer(str(expected)) or str(expected)
        found = extract_answer(completion_text(completion))
        scores.append(1.0 if found is not None and normalize_answer(found) == normalize_answer(reference) else 0.0)
    return scores


def regex_format(completions: list[Any], pattern: str = FORMAT_PATTERN, **kwargs: Any) -> list[float | None]:
    """1.0 when the whole stripped completion matches ``pattern`` (``re.DOTALL``), else 0.0.

    Set ``pattern`` in the score node's ``params``; the default asks for
    ``<think>...</think><answer>...</answer>``.
    """
    compiled = re.compile(pattern, re.DOTALL)
    return [1.0 if compiled.fullmatch(completion_text(c).strip()) else 0.0 for c in completions]


def length_penalty(
    completion_ids: list[list[int]], max_new_tokens: int, max_length: int | None = None,
    buffer: int | None = None, **kwargs: Any,
) -> list[float | None]:
    """A soft penalty for long completions (DAPO's overlong shaping), in [-1, 0].

    With ``L`` = ``max_length`` (default: the generate node's ``max_new_tokens``) and
    ``B`` = ``buffer`` (default ``L // 4``), a completion of ``n`` tokens scores::

        0                    when n <= L - B
        (L - B - n) / B      when L - B < n <= L   (falling linearly to -1)
        -1                   when n > L

    Add it to a task reward with its own score node (weights add up).
    """
    limit = max_length if max_length is not None else max_new_tokens
    margin = buffer if buffer is not None else max(1, limit // 4)
    scores: list[float | None] = []
    for ids in completion_ids:
        length = len(ids)
        if length <= limit - margin:
            scores.append(0.0)
        elif length <= limit:
            scores.append((limit - margin - length) / margin)
        else:
            scores.append(-1.0)
    return scores


REWARD_FUNCTIONS: dict[str, RewardFunction] = {
    "digits": digit_match,
    "first_letter": first_letter_match,
    "exact_match": exact_match,
    "math_answer": math_answer,
    "regex_format": regex_format,
    "length_penalty": length_penalty,
}
"""Registry name (the ``fn`` of a score node) -> reward function."""


def register_reward(name: str, fn: RewardFunction) -> None:
    """Add a reward function under ``name``; re-registering a name is a programming error."""
    if name in REWARD_FUNCTIONS and REWARD_FUNCTIONS[name] is not fn:
        raise ValueError(f"a reward function named {name!r} is already registered")
    REWARD_FUNCTIONS[name] = fn
