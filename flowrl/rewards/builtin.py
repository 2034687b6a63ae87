"""Rule-based reward functions shipped with flowrl, and their registry.

Every reward function has the signature of :class:`RewardFunction`: whole lists in, one float
per completion out, so a function can batch its work (call a service, run a checker).
"""

from __future__ import annotations

from typing import Protocol

DIGIT_CHARACTERS = frozenset("0123456789")


class RewardFunction(Protocol):
    """``fn(prompts, completions, answers, max_new_tokens) -> one float per completion``.

    ``answers[i]`` is the reference answer of the prompt that ``completions[i]`` answers (None
    when the data has none); ``max_new_tokens`` is the generate node's limit, for normalising.
    """

    def __call__(
        self,
        prompts: list[str],
        completions: list[str],
        answers: list[str | None],
        max_new_tokens: int,
    ) -> list[float]: ...


def digit_match(
    prompts: list[str], completions: list[str], answers: list[str | None], max_new_tokens: int
) -> list[float]:
    """Share of the completion that is ASCII digits: ``digits / max_new_tokens``, in [0, 1].

    Dense from a random-init model (about 1 character in 8 of the built-in character
    vocabulary is a digit), so GRPO groups almost always differ; 1.0 is a completion of only
    digits that uses the whole token budget.
    """
    limit = max(max_new_tokens, 1)
    return [
        min(1.0, sum(char in DIGIT_CHARACTERS for char in completion) / limit)
        for completion in completions
    ]


def first_letter_match(
    prompts: list[str], completions: list[str], answers: list[str | None], max_new_tokens: int
) -> list[float]:
    """Reward for repeating the prompt's first letter: half presence, half leading run.

    With ``target`` = the answer (or, when it is None, the prompt's first character) and
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
    scores = []
    for prompt, completion, answer in zip(prompts, completions, answers):
        target = answer if answer else prompt[:1]
        head = completion[:limit]
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


def exact_match(
    prompts: list[str], completions: list[str], answers: list[str | None], max_new_tokens: int
) -> list[float]:
    """1.0 when the stripped completion starts with the stripped answer, else 0.0.

    "starts with" rather than "equals" because generation runs to ``max_new_tokens`` and a
    correct answer is often followed by more text. An example without an answer is an error
    (it would silently score 0 forever): give every line of the data an ``answer``.
    """
    scores = []
    for index, (completion, answer) in enumerate(zip(completions, answers)):
        if answer is None or not answer.strip():
            raise ValueError(
                f"exact_match needs a reference answer, but prompt {index} has none; "
                "add an 'answer' field to every line of the data"
            )
        scores.append(1.0 if completion.strip().startswith(answer.strip()) else 0.0)
    return scores


REWARD_FUNCTIONS: dict[str, RewardFunction] = {
    "digits": digit_match,
    "first_letter": first_letter_match,
    "exact_match": exact_match,
}
"""Registry name (the ``fn`` of a score node) -> reward function."""


def register_reward(name: str, fn: RewardFunction) -> None:
    """Add a reward function under ``name``; re-registering a name is a programming error."""
    if name in REWARD_FUNCTIONS and REWARD_FUNCTIONS[name] is not fn:
        raise ValueError(f"a reward function named {name!r} is already registered")
    REWARD_FUNCTIONS[name] = fn
