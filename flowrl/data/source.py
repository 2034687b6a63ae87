"""PromptSource: the ``prompts`` output of a pipeline, one batch per step.

A batch is a pure function of ``(seed, step)``: nothing is consumed from an iterator, so a run
resumed at step k sees exactly the batches it would have seen without the interruption.

A dataset (a file, a saved folder, a hub dataset, a built-in dataset) is read as one endless
stream, epoch after epoch; epoch e is a permutation seeded by ``(seed, e)`` (or the data's
order when ``shuffle`` is off). Step s takes stream positions ``[s * batch_size, (s + 1) *
batch_size)``, so a batch that crosses an epoch boundary takes the last examples of one epoch
and the first of the next: no example is skipped, none repeats within an epoch. A built-in
task draws fresh random prompts for every step instead.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import random
from collections.abc import Collection
from pathlib import Path
from typing import Any

from flowrl.data.builtin import BUILTIN_DATASETS, BUILTIN_TASKS, BuiltinTask
from flowrl.data.examples import PromptExample
from flowrl.data.files import SINGLE_SPLIT, SPLIT_FIELD, SUBSET_FIELD, has_splits, load_split
from flowrl.data.formatting import FormatCounts, PromptFormatter, check_columns
from flowrl.errors import DataError

BUILTIN_PREFIX = "builtin:"
EVAL_SPLIT = "test"
"""The split evaluated when ``eval.split`` is not given and the source has splits."""


def _builtin_name(name: str) -> str:
    known = [*BUILTIN_TASKS, *BUILTIN_DATASETS]
    if name in known:
        return name
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean '{BUILTIN_PREFIX}{close[0]}'?)" if close else ""
    names = ", ".join(BUILTIN_PREFIX + task for task in known)
    raise DataError(f"unknown built-in data '{name}'{hint}; the built-in tasks and datasets are: {names}")


def endless_task(source: str) -> str:
    """Why a built-in task cannot give a split (an evaluation's held-out prompts)."""
    return (f"{source} is a task of endless random prompts, not a dataset with splits: give eval.source a "
            "dataset of held-out prompts (a file, a folder, or builtin:arith)")


def is_endless_task(source: str) -> bool:
    """Whether ``source`` names a built-in task of random prompts (no splits)."""
    if not source.startswith(BUILTIN_PREFIX):
        return False
    try:
        return _builtin_name(source[len(BUILTIN_PREFIX):]) in BUILTIN_TASKS
    except DataError:
        return False


def read_examples(
    source: str,
    split: str,
    subset: str | None,
    base_dir: Path | None,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    formatter: PromptFormatter | None = None,
    section: str = "data",
    answer_key_named: bool = True,
) -> tuple[list[PromptExample], FormatCounts]:
    """Every usable example of ``split`` of a dataset source, in the data's order; messages
    name the pipeline ``section`` whose ``prompt_key`` and ``answer_key`` were used.
    ``answer_key_named``: the section named the answer column itself (not inherited from
    ``data``), so a column it lacks is refused."""
    formatter = formatter or PromptFormatter()
    location = source
    if source.startswith(BUILTIN_PREFIX):
        name = _builtin_name(source[len(BUILTIN_PREFIX):])
        if name in BUILTIN_TASKS:
            raise DataError(endless_task(source))
        location = str(BUILTIN_DATASETS[name](None))
    try:
        rows = load_split(location, split, subset, base_dir)
    except DataError as error:
        if error.field in (SPLIT_FIELD, SUBSET_FIELD):
            error.field = f"{section}.{error.field}"
        raise
    display = source if split == SINGLE_SPLIT and not has_splits(location, base_dir) else f"{source} (split {split})"
    problems = []
    if prompt_key not in rows.column_names:
        problems.append(DataError(
            f"{display} has no column '{prompt_key}' (columns: {', '.join(rows.column_names)}); "
            f"set {section}.prompt_key to the column that holds the prompts", field=f"{section}.prompt_key"
        ))
    try:
        check_columns(list(rows.column_names), answer_key, display, section, answer_key_named)
    except DataError as error:
        problems.append(error)
    if problems:  # every column problem at once
        problems[0].also = problems[1:]
        raise problems[0]
    examples, counts = formatter.examples(rows.to_list(), prompt_key, answer_key, display)
    if not examples:
        raise DataError(f"{display} holds no usable prompt ({counts.num_rows} rows, {counts.num_skipped} skipped as too long)")
    return examples, counts


def eval_split(source: str | None, split: str | None, data_source: str, base_dir: Path | None) -> str:
    """The split an evaluation reads: the one given, else ``test`` of a source with splits,
    else the single file's only split."""
    if split is not None:
        return split
    chosen = source or data_source
    if chosen.startswith(BUILTIN_PREFIX):
        return EVAL_SPLIT
    return EVAL_SPLIT if has_splits(chosen, base_dir) else SINGLE_SPLIT


TASK_STEPS_CHECKED = 64
"""Steps whose batches of a built-in task are measured against a prompt-length limit when the
source is built (a prompt longer than it would otherwise stop the run at its step)."""


class PromptSource:
    """Batches of prompts from a built-in task or a dataset.

    Args:
        source: ``"builtin:NAME"``, a data file, a saved dataset folder or a hub name
            (relative paths are resolved against ``base_dir``, the pipeline file's folder).
        batch_size: prompts per step.
        seed: the run's seed (``trainer.seed``).
        base_dir: folder that relative paths are resolved against.
        shuffle: permute a dataset's examples each epoch; built-in tasks always draw fresh
            random prompts, so it does not apply to them.
        prompt_key: column holding the prompt.
        answer_key: column holding the reference answer (may be absent).
        split, subset: which split (and hub configuration) to read.
        formatter: renders chats and bounds prompt lengths (a plain one by default).

    A dataset is read and checked completely here, so a bad row fails before any model loads.
    """

    def __init__(
        self,
        source: str,
        batch_size: int,
        seed: int,
        base_dir: Path | None,
        shuffle: bool = True,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        split: str = SINGLE_SPLIT,
        subset: str | None = None,
        formatter: PromptFormatter | None = None,
    ) -> None:
        if batch_size < 1:
            raise DataError(f"data.batch_size must be >= 1, got {batch_size}")
        self.source = source
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.formatter = formatter or PromptFormatter()
        self.task: BuiltinTask | None = None
        self.examples: list[PromptExample] = []
        self.counts = FormatCounts(0)
        self._permutations: dict[int, list[int]] = {}
        if source.startswith(BUILTIN_PREFIX) and _builtin_name(source[len(BUILTIN_PREFIX):]) in BUILTIN_TASKS:
            self.task = BUILTIN_TASKS[source[len(BUILTIN_PREFIX):]]
            # A length limit a prompt exceeds fails here, before step 1: with a subword
            # tokenizer the random prompts' lengths vary, so the first steps' batches are read
            # (a step's batch depends only on the seed and the step: these are the run's own).
            for step in range(TASK_STEPS_CHECKED if self.formatter.limited else 1):
                self.next_batch(step)
            return
        local = base_dir is not None and (Path(base_dir) / source).exists()
        if not local and source in BUILTIN_TASKS:
            raise DataError(
                f"data file {source} not found; did you mean the built-in task '{BUILTIN_PREFIX}{source}'?"
            )
        self.examples, self.counts = read_examples(
            source, split, subset, base_dir, prompt_key, answer_key, self.formatter
        )

    @classmethod
    def from_spec(
        cls, data_spec: Any, seed: int, base_dir: Path | None, formatter: PromptFormatter | None = None
    ) -> PromptSource:
        """Build from a pipeline's ``data`` section (any object with DataSpec's fields)."""
        return cls(
            source=data_spec.source,
            batch_size=data_spec.batch_size,
            seed=seed,
            base_dir=base_dir,
            shuffle=data_spec.shuffle,
            prompt_key=data_spec.prompt_key,
            answer_key=data_spec.answer_key,
            split=data_spec.split,
            subset=data_spec.subset,
            formatter=formatter,
        )

    @property
    def num_examples(self) -> int | None:
        """Examples in the dataset, or None for a built-in task (endless)."""
        return None if self.task is not None else len(self.examples)

    def fingerprint(self) -> dict[str, Any] | None:
        """The rows read, as a count and a SHA-256 of each example's prompt, answer and
        columns in order: a resumed run sees the batches an uninterrupted one would only
        while these are the same. None for a built-in task (its prompts are made per step)."""
        if self.task is not None:
            return None
        digest = hashlib.sha256()
        for example in self.examples:
            row = [example.prompt, example.answer, example.columns]
            digest.update(json.dumps(row, sort_keys=True, ensure_ascii=False, default=str).encode())
            digest.update(b"\n")
        return {"rows": len(self.examples), "sha256": digest.hexdigest()}

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
            made = [self.task.make_example(rng) for _ in range(self.batch_size)]
            return self._format_task(made)
        num_examples = len(self.examples)
        first = step * self.batch_size
        batch = []
        for position in range(first, first + self.batch_size):
            epoch, offset = divmod(position, num_examples)
            batch.append(self.examples[self._permutation(epoch)[offset]])
        return batch

    def length_metrics(self, batch: list[PromptExample]) -> dict[str, float]:
        """Where prompts have a bound (``max_prompt_tokens``, else the room the models leave
        with ``truncate_left`` or ``skip``): the batch's prompts cut to it, and the dataset's
        rows left out for exceeding it (``skip``)."""
        if self.formatter.bound is None:
            return {}
        return {
            "data/prompts_truncated": float(sum(1 for example in batch if example.meta.get("truncated"))),
            "data/prompts_skipped": float(self.counts.num_skipped),
        }

    def _format_task(self, made: list[PromptExample]) -> list[PromptExample]:
        """A built-in task's examples through the same length policy as a dataset's rows: its
        ``max_prompt_tokens``, else the room the models leave a prompt (a GPT-2 of 16 positions
        ran its 9-token prompts into 12 new tokens, past its position table)."""
        if not self.formatter.limited:
            return made
        rows = [{"prompt": example.prompt, **({"answer": example.answer} if example.answer is not None else {})} for example in made]
        formatted, _ = self.formatter.examples(rows, "prompt", "answer", self.source, can_skip=False)
        if len(formatted) < len(made):
            raise DataError(
                f"{self.source}'s prompts are longer than {self.formatter.bound_name} and a built-in task "
                "cannot skip them; set overlong_prompts: truncate_left, or "
                + ("raise max_prompt_tokens" if self.formatter.max_prompt_tokens is not None
                   else "ask for fewer new tokens")
            )
        return [
            PromptExample(f.prompt, f.answer, {**m.meta, **f.meta}, f.columns, f.data_prompt, f.prompt_ids, f.chat)
            for f, m in zip(formatted, made)
        ]

    def _permutation(self, epoch: int) -> list[int]:
        if epoch not in self._permutations:
            order = list(range(len(self.examples)))
            if self.shuffle:
                random.Random(f"flowrl-data:epoch:{self.seed}:{epoch}").shuffle(order)
            if len(self._permutations) >= 4:  # a batch touches at most a few epochs
                self._permutations.pop(next(iter(self._permutations)))
            self._permutations[epoch] = order
        return self._permutations[epoch]

    def batch_warning(self) -> str | None:
        """What to say when a step's batch is larger than the dataset: it repeats prompts."""
        if self.task is not None or not self.examples or self.batch_size <= len(self.examples):
            return None
        return (f"data.batch_size {self.batch_size} is larger than the {len(self.examples)} prompts of "
                f"{self.source}: every step repeats prompts ({self.batch_size / len(self.examples):.3g} epochs "
                "per step); lower data.batch_size or add prompts")

    def describe(self, reward_functions: Collection[str] | None = None) -> str:
        """One line for logs: what the prompts are and how they are batched; for a built-in
        task, what its reward function rewards when the pipeline scores with it (one of
        ``reward_functions``, the score nodes' functions; None: say it)."""
        if self.task is not None:
            task = self.task
            scored = reward_functions is None or task.reward in reward_functions
            reward = f"; reward: {task.reward_description}" if scored else ""
            return (
                f"{BUILTIN_PREFIX}{task.name}: {task.description}{reward}; "
                f"{self.batch_size} random prompts per step (seed {self.seed})"
            )
        num_examples = len(self.examples)
        order = f"shuffled each epoch (seed {self.seed})" if self.shuffle else "in the data's order"
        steps_per_epoch = num_examples / self.batch_size
        counts = self.counts
        notes = []
        if counts.num_chat:
            notes.append(f"{counts.num_chat} chats rendered with the chat template")
        bound = self.formatter.bound_name
        if counts.num_truncated:
            notes.append(f"{counts.num_truncated} truncated on the left to {bound}")
        if counts.num_skipped:
            notes.append(f"{counts.num_skipped} longer than {bound} skipped")
        extra = f"; {', '.join(notes)}" if notes else ""
        return (
            f"{self.source}: {num_examples} prompts, {order}, {self.batch_size} per step "
            f"({_short_number(steps_per_epoch)} steps per epoch){extra}"
        )


def _short_number(value: float) -> str:
    """``5.71``, ``12``, ``1,219``, ``0.0039``: two decimals at most below 100, none above, two
    significant digits below 1."""
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.2f}".rstrip("0").rstrip(".") if value >= 1 else f"{value:.2g}"
