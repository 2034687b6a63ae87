"""The arithmetic task's problems and their train/test split (no torch: the planner and the
data layer read them).

Every problem is ``a+b=`` or ``a-b=`` for operands 0..99; a fixed, seeded draw holds
``num_test`` of them out for evaluation.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

LARGEST_OPERAND = 99
"""Operands run from 0 to this."""


@dataclass(frozen=True)
class ArithProblem:
    """One problem: the prompt the model sees and its exact answer."""

    prompt: str
    """The expression and ``=``, e.g. ``37+45=``."""
    answer: str
    """The value in decimal, e.g. ``82`` or ``-22``."""

    @property
    def worked(self) -> str:
        """The completion the supervised fit teaches: working, ``;``, result."""
        return self.answer.lstrip("-")[::-1] + ";" + self.answer


@dataclass(frozen=True)
class ArithData:
    """Which problems go to which split; changing a field changes the dataset."""

    num_test: int = 500
    """Problems held out for evaluation; every other problem is in the train split."""
    seed: int = 0
    """Seed of the draw of the test problems."""
    version: int = 1
    """Bumped whenever the problems would change, so stale caches are never reused."""


def all_problems() -> list[ArithProblem]:
    """Every problem of the task: ``a+b`` and ``a-b`` for a, b in 0..99 (20,000)."""
    problems = []
    for left in range(LARGEST_OPERAND + 1):
        for right in range(LARGEST_OPERAND + 1):
            problems.append(ArithProblem(f"{left}+{right}=", str(left + right)))
            problems.append(ArithProblem(f"{left}-{right}=", str(left - right)))
    return problems


def arith_problems(data: ArithData = ArithData()) -> dict[str, list[ArithProblem]]:
    """The ``train`` and ``test`` splits: ``num_test`` problems drawn from ``data.seed`` are
    the test split, the rest (in the task's order) the train split."""
    problems = all_problems()
    order = list(range(len(problems)))
    random.Random(f"flowrl-arith-{data.seed}").shuffle(order)
    held_out = set(order[: data.num_test])
    return {
        "train": [problem for index, problem in enumerate(problems) if index not in held_out],
        "test": [problems[index] for index in order[: data.num_test]],
    }
