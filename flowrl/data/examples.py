"""The unit of data flowing out of a prompt source."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PromptExample:
    """One prompt given to the generate node, with what the reward may compare against.

    ``prompt`` is the text the model continues (a chat already rendered by the tokenizer's
    chat template). ``answer`` is the reference answer as text (``None`` when the task has
    none, e.g. ``digits``). ``columns`` holds the example's dataset row as the data holds it
    (the prompt column a chat, numbers as numbers): reward functions receive every column
    by its name. ``meta`` says where the example came from (task name, or file and row), for
    logs and custom code; flowrl's math never reads it.
    """

    prompt: str
    answer: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    columns: dict[str, Any] = field(default_factory=dict)
    """Dataset column -> this example's value (reward keyword arguments)."""
    data_prompt: Any = None
    """The prompt as the data holds it (a string, or a list of chat messages); None: ``prompt``."""
    prompt_ids: tuple[int, ...] | None = None
    """Token ids to generate from instead of tokenizing ``prompt`` (a prompt cut to
    ``data.max_prompt_tokens``); None: tokenize ``prompt``."""
    chat: bool = False
    """The prompt is a chat: reward functions get completions as assistant messages."""

    @property
    def reward_prompt(self) -> Any:
        """What reward functions receive as this example's ``prompts`` entry."""
        return self.prompt if self.data_prompt is None else self.data_prompt
