"""Built-in toy tasks: prompts generated on the fly, so any step's batch exists without files.

Both tasks show a prompt of 8 random lowercase letters followed by ``=``; the reward function
of the same name in :mod:`flowrl.rewards` says what a good completion is. A random-init
character-level model can learn either in a few hundred steps on CPU.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flowrl.data.arith import arith_dataset_dir
from flowrl.data.examples import PromptExample

PROMPT_LETTERS = 8
"""Random lowercase letters in a built-in prompt, before the trailing ``=``."""


@dataclass(frozen=True)
class BuiltinTask:
    """A named generator of prompts plus the reward function that grades it."""

    name: str
    description: str
    """What the prompts are."""
    reward: str
    """Name of the matching function in flowrl.rewards' registry."""
    reward_description: str
    """What that function rewards."""
    make_example: Callable[[random.Random], PromptExample]


def _letters_prompt(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(PROMPT_LETTERS)) + "="


def _digits_example(rng: random.Random) -> PromptExample:
    prompt = _letters_prompt(rng)
    return PromptExample(prompt=prompt, answer=None, meta={"task": "digits"}, columns={"prompt": prompt})


def _first_letter_example(rng: random.Random) -> PromptExample:
    prompt = _letters_prompt(rng)
    return PromptExample(
        prompt=prompt, answer=prompt[0], meta={"task": "first_letter"}, columns={"prompt": prompt, "answer": prompt[0]}
    )


BUILTIN_TASKS: dict[str, BuiltinTask] = {
    "digits": BuiltinTask(
        name="digits",
        description="8 random letters + '='",
        reward="digits",
        reward_description="share of digit characters in the completion",
        make_example=_digits_example,
    ),
    "first_letter": BuiltinTask(
        name="first_letter",
        description="8 random letters + '='",
        reward="first_letter",
        reward_description="repeat the prompt's first letter",
        make_example=_first_letter_example,
    ),
}
"""Task name (``data.source: builtin:NAME``) -> task."""

BUILTIN_DATASETS: dict[str, Callable[[Path | None], Path]] = {"arith": arith_dataset_dir}
"""Dataset name (``data.source: builtin:NAME``) -> a function that writes the dataset once
(into the cache folder given, or the default one) and returns its folder of split files."""
