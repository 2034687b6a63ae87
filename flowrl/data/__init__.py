"""Prompt data: built-in tasks and datasets read with ``datasets``, batched deterministically by step."""

from __future__ import annotations

from flowrl.data.builtin import BUILTIN_DATASETS, BUILTIN_TASKS, BuiltinTask
from flowrl.data.examples import PromptExample
from flowrl.data.formatting import PromptFormatter
from flowrl.data.source import PromptSource, eval_split, read_examples

__all__ = [
    "BUILTIN_DATASETS", "BUILTIN_TASKS", "BuiltinTask", "PromptExample", "PromptFormatter", "PromptSource",
    "eval_split", "read_examples",
]
