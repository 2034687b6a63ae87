"""The unit of data flowing out of a prompt source."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PromptExample:
    """One prompt given to the generate node, with what the reward may compare against.

    ``answer`` is the reference answer (``None`` when the task has none, e.g. ``digits``).
    ``meta`` holds where the example came from (task name, or file line and the line's other
    fields); it is for logging and custom code, never read by flowrl's own math.
    """

    prompt: str
    answer: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
