"""Prompt data: built-in toy tasks and JSON Lines files, batched deterministically by step."""

from __future__ import annotations

from flowrl.data.builtin import BUILTIN_TASKS, BuiltinTask
from flowrl.data.examples import PromptExample
from flowrl.data.jsonl import load_jsonl
from flowrl.data.source import PromptSource

__all__ = ["BUILTIN_TASKS", "BuiltinTask", "PromptExample", "PromptSource", "load_jsonl"]
