"""PromptSource: the ``prompts`` output of a pipeline, one batch per step.

A batch is a pure function of ``(seed, step)``: nothing is consumed from an iterator, so a run
resumed at step k sees exactly the batches it would have seen without the interruption.

For a ``.jsonl`` file the examples are read as one endless stream, epoch after epoch; epoch e
is a permutation seeded by ``(seed, e)`` (or file order when ``shuffle`` is off). Step s takes
stream positions ``[s * batch_size, (s + 1) * batch_size)``, so a batch that crosses an epoch
boundary takes the last examples of one epoch and the first of the next: no example is
skipped, none repeats within an epoch.
"""

from __future__ import annotations

import difflib
import random
from pathlib import Path
from typing import Any

from flowrl.data.builtin import BUILTIN_TASKS, BuiltinTask
from flowrl.data.examples import PromptExample
from flowrl.data.jsonl import load_jsonl
from flowrl.errors import DataError

BUILTIN_PREFIX = "builtin:"


def _builtin_task(name: str) -> BuiltinTask:
    if name in BUILTIN_TASKS:
        return BUILTIN_TASKS[name]
    close = difflib.get_close_matches(name, list(BUILTIN_TASKS), n=1)
    hint = f" (did you mean '{BUILTIN_PREFIX}{close[0]}'?)" if close else ""
    known = ", ".join(BUILTIN_PREFIX + task for task in BUILTIN_TASKS)
    raise DataError(f"unknown built-in task '{name}'{hint}; the built-in tasks are: {known}")


class PromptSource:
    """Batches of prompts from a built-in task or a JSON Lines file.

    Args:
        source: ``"builtin:NAME"`` or a path to a ``.jsonl`` file (relative paths are resolved
            against ``base_dir``, the pipeline file's folder).
        batch_size: prompts per step.
        seed: the run's seed (``trainer.seed``).
        base_dir: folder that relative paths are resolved against.
        shuffle: permute a file's examples each epoch; built-in tasks always draw fresh
            random prompts, so it does not apply to them.
        prompt_field: JSON field holding the prompt.
        answer_field: JSON field holding the reference answer (optional in each line).

    A file is read and checked completely here, so a bad line fails before any model loads.
    """

    def __init__(
        self,
        source: str,
        batch_size: int,
        seed: int,
        base_dir: Path,
        shuffle: bool = True,
        prompt_field: str = "prompt",
        answer_field: str = "answer",
    ) -> None:
        if batch_size < 1:
            raise DataError(f"data.batch_size must be >= 1, got {batch_size}")
        self.source = source
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.task: BuiltinTask | None = None
        self.examples: list[PromptExample] = []
        self._permutations: dict[int, list[int]] = {}
        if source.startswith(BUILTIN_PREFIX):
            self.task = _builtin_task(source[len(BUILTIN_PREFIX) :])
            return
        path = Path(source).expanduser()
        if not path.is_absolute():
            path = Path(base_dir) / path
        if not path.exists() and source in BUILTIN_TASKS:
            raise DataError(
                f"data file {source} not found (looked at {path}); "
                f"did you mean the built-in task '{BUILTIN_PREFIX}{source}'?"
            )
        self.examples = load_jsonl(path, source, prompt_field, answer_field)

    @classmethod
    def from_spec(cls, data_spec: Any, seed: int, base_dir: Path) -> PromptSource:
        """Build from a pipeline's ``data`` section (any object with DataSpec's fields)."""
        return cls(
            source=data_spec.source,
            batch_size=data_spec.batch_size,
            seed=seed,
            base_dir=base_dir,
            shuffle=data_spec.shuffle,
            prompt_field=data_spec.prompt_key,
            answer_field=data_spec.answer_key,
        )

    @property
    def num_examples(self) -> int | None:
        """Examples in the file, or None for a built-in task (endless)."""
        return None if self.task is not None else len(self.examples)

    def epoch_of(self, step: int) -> int:
        """Epoch that the first example of ``step``'s batch belongs to (0 for built-ins)."""
        if self.task is not None:
            return 0
        return (step * self.batch_size) // len(self.examples)

    def next_batch(self, step: int) -> list[PromptExample]:
        """The ``batch_size`` prompts of ``step`` (0-based); same inputs, same batch."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self.task is not None:
            # A string seed is hashed with SHA-512 by random.Random: stable across processes
            # and Python versions, unlike hash().
            rng = random.Random(f"flowrl-data:{self.task.name}:{self.seed}:{step}")
            return [self.task.make_example(rng) for _ in range(self.batch_size)]
        num_examples = len(self.examples)
        first = step * self.batch_size
        batch = []
        for position in range(first, first + self.batch_size):
            epoch, offset = divmod(position, num_examples)
            batch.append(self.examples[self._permutation(epoch)[offset]])
        return batch

    def _permutation(self, epoch: int) -> list[int]:
        if epoch not in self._permutations:
            order = list(range(len(self.examples)))
            if self.shuffle:
                random.Random(f"flowrl-data:epoch:{self.seed}:{epoch}").shuffle(order)
            if len(self._permutations) >= 4:  # a batch touches at most a few epochs
                self._permutations.pop(next(iter(self._permutations)))
            self._permutations[epoch] = order
        return self._permutations[epoch]

    def describe(self) -> str:
        """One line for logs: what the prompts are and how they are batched."""
        if self.task is not None:
            return (
                f"{BUILTIN_PREFIX}{self.task.name}: {self.task.description}; "
                f"{self.batch_size} random prompts per step (seed {self.seed})"
            )
        num_examples = len(self.examples)
        order = f"shuffled each epoch (seed {self.seed})" if self.shuffle else "in file order"
        steps_per_epoch = num_examples / self.batch_size
        return (
            f"{self.source}: {num_examples} prompts, {order}, {self.batch_size} per step "
            f"({steps_per_epoch:g} steps per epoch)"
        )
