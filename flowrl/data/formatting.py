"""Dataset rows -> prompt examples: the prompt column checked, chats rendered, lengths bounded.

A prompt is a string, or a chat: a list of ``{"role": ..., "content": ...}`` messages,
rendered with the policy tokenizer's chat template (the generation prompt added), as TRL
and verl render conversational data. With ``max_prompt_tokens`` every prompt is measured
in the policy's tokens once, when the data is loaded, so a prompt that is too long stops
the run before step 1 (``error``), or is cut to its last tokens (``truncate_left``), or is
left out of the data (``skip``); which rows a step sees stays a function of the seed and
the step alone.
"""

from __future__ import annotations

import copy

import difflib
from dataclasses import dataclass
from typing import Any, Literal

from flowrl.data.examples import PromptExample
from flowrl.data.jsonl import raise_listed
from flowrl.errors import DataError

OverlongPolicy = Literal["error", "truncate_left", "skip"]

RESERVED_COLUMNS = ("prompts", "completions", "completion_ids", "max_new_tokens")
"""Keywords a reward function receives from flowrl itself; a column of that name would clash."""


@dataclass(frozen=True)
class FormatCounts:
    """What formatting did to a dataset's prompts."""

    num_rows: int
    num_chat: int = 0
    num_truncated: int = 0
    num_skipped: int = 0


TOKENIZE_CHUNK = 4096
"""Prompts tokenized per call when lengths are measured."""


class PromptFormatter:
    """Turns rows into PromptExamples for one policy tokenizer.

    Args:
        tokenizer: the policy's tokenizer, or a function returning it (called only when
            needed: for chat prompts and for ``max_prompt_tokens``); may be None otherwise.
        tokenizer_name: how to name the tokenizer's model in errors.
        max_prompt_tokens: longest prompt in tokens; None for no limit.
        overlong: what a longer prompt does (see module docstring).
        room: without ``max_prompt_tokens``, the longest prompt the models' positions leave
            room for beside the longest completion (a longer one is cut or left out as
            ``overlong`` says, or an error with ``error``); None where unknown.
        room_why: the numbers behind ``room``, for its error.
    """

    def __init__(
        self,
        tokenizer: Any | None = None,
        tokenizer_name: str = "the policy",
        max_prompt_tokens: int | None = None,
        overlong: OverlongPolicy = "error",
        room: int | None = None,
        room_why: str = "",
    ) -> None:
        if (max_prompt_tokens is not None or room is not None) and tokenizer is None:
            raise ValueError("max_prompt_tokens and room need the policy's tokenizer")
        self._tokenizer = tokenizer
        self.tokenizer_name = tokenizer_name
        self.max_prompt_tokens = max_prompt_tokens
        self.overlong = overlong
        self.room = None if max_prompt_tokens is not None else room
        self.room_why = room_why

    @property
    def limited(self) -> bool:
        """Whether prompts are measured at all: ``max_prompt_tokens`` or a known room."""
        return self.max_prompt_tokens is not None or self.room is not None

    @property
    def bound(self) -> int | None:
        """The prompt length longer prompts are cut to or left out at: ``max_prompt_tokens``,
        else the room the models leave where ``overlong`` cuts or skips (with ``error`` a
        prompt beyond the room stops the run instead); None: no bound."""
        if self.max_prompt_tokens is not None:
            return self.max_prompt_tokens
        return self.room if self.overlong != "error" else None

    @property
    def bound_name(self) -> str:
        """How messages name :attr:`bound`."""
        if self.max_prompt_tokens is not None or self.room is None:
            return "data.max_prompt_tokens"
        return f"the {self.room} tokens a prompt has room for"

    def with_room(self, room: int | None, why: str = "") -> "PromptFormatter":
        """This formatter with another room (held-out prompts: the evaluation's own
        completion length and the policy's positions); ``max_prompt_tokens`` still wins."""
        other = copy.copy(self)
        other.room = None if self.max_prompt_tokens is not None else room
        other.room_why = why
        return other

    @property
    def tokenizer(self) -> Any | None:
        if callable(self._tokenizer) and not hasattr(self._tokenizer, "apply_chat_template"):
            self._tokenizer = self._tokenizer()
        return self._tokenizer

    def examples(
        self, rows: list[dict[str, Any]], prompt_key: str, answer_key: str, display_name: str,
        first_row: int = 0, can_skip: bool = True,
    ) -> tuple[list[PromptExample], FormatCounts]:
        """The rows' examples (skipped ones left out) and counts; DataError listing every
        bad row. ``first_row`` numbers the rows in messages (1-based row = first_row + i + 1);
        ``can_skip``: whether messages may offer ``skip`` (a built-in task makes its prompts
        per step and cannot leave one out)."""
        fixes = "truncate_left or skip" if can_skip else "truncate_left"
        problems: list[str] = []
        texts: list[str] = []
        kept_rows: list[tuple[int, dict[str, Any], bool]] = []
        for index, row in enumerate(rows):
            number = first_row + index + 1
            text, chat, why = self._render(row, prompt_key)
            if why is not None:
                problems.append(f"{display_name}: row {number}: {why}")
                continue
            texts.append(text)
            kept_rows.append((number, row, chat))
        _raise_if(problems, display_name, f"each row needs a non-empty string or a list of chat messages in '{prompt_key}'")
        lengths = self._lengths(texts)
        examples: list[PromptExample] = []
        truncated = skipped = 0
        too_long: list[str] = []
        no_room: list[str] = []
        for (number, row, chat), text, (length, ids) in zip(kept_rows, texts, lengths):
            prompt_ids: tuple[int, ...] | None = None
            limit = self.max_prompt_tokens
            if self.room is not None:
                if length > self.room and self.overlong == "error":
                    no_room.append(f"{display_name}: row {number}: {length} tokens")
                    continue
                # without max_prompt_tokens, truncate_left and skip cut at the room the model leaves
                limit = self.room
            if limit is not None and ids is not None and length > limit:
                if self.overlong == "error":
                    too_long.append(f"{display_name}: row {number}: {length} tokens")
                    continue
                if self.overlong == "skip":
                    skipped += 1
                    continue
                prompt_ids = tuple(ids[-limit:])
                text = self.tokenizer.decode(list(prompt_ids))  # type: ignore[union-attr]
                truncated += 1
            answer = row.get(answer_key)
            columns = dict(row)
            if answer_key in row:
                columns["answer"] = answer
            examples.append(
                PromptExample(
                    prompt=text,
                    answer=None if answer is None else str(answer),
                    meta={"source": display_name, "row": number, "truncated": prompt_ids is not None},
                    columns=columns,
                    data_prompt=row[prompt_key] if chat else None,
                    prompt_ids=prompt_ids,
                    chat=chat,
                )
            )
        if too_long:
            _raise_if(
                too_long, display_name,
                f"longer than data.max_prompt_tokens = {self.max_prompt_tokens} tokens of the tokenizer of "
                f"{self.tokenizer_name}; raise max_prompt_tokens, or set data.overlong_prompts to {fixes}",
            )
        if no_room:
            _raise_if(
                no_room, display_name,
                f"longer than the {self.room} tokens (of the tokenizer of {self.tokenizer_name}) a prompt has room "
                f"for: {self.room_why}; set data.overlong_prompts: {fixes} (at that room, or at a "
                "data.max_prompt_tokens below it), or ask for fewer new tokens",
            )
        counts = FormatCounts(len(rows), sum(chat for _, _, chat in kept_rows), truncated, skipped)
        return examples, counts

    def _render(self, row: dict[str, Any], prompt_key: str) -> tuple[str, bool, str | None]:
        """(prompt text, is a chat, None) or ("", False, what is wrong with the row)."""
        if prompt_key not in row:
            columns = ", ".join(f"'{key}'" for key in row) or "none"
            return "", False, f"no column '{prompt_key}' (columns: {columns}; set data.prompt_key)"
        value = row[prompt_key]
        if value is None:
            return "", False, f"'{prompt_key}' is null (missing in this row, or an empty CSV cell)"
        if isinstance(value, str):
            if not value.strip():  # nothing to generate from (a tokenizer may give it no token at all)
                return "", False, f"an empty '{prompt_key}'" if not value else f"only white space in '{prompt_key}'"
            return value, False, None
        if isinstance(value, list):
            why = _chat_problem(value)
            if why is not None:
                return "", False, f"'{prompt_key}' is a list but {why}"
            return self._apply_template(value), True, None
        return "", False, f"'{prompt_key}' is {type(value).__name__} {_short(value)}"

    def _apply_template(self, messages: list[dict[str, Any]]) -> str:
        tokenizer = self.tokenizer
        if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
            raise DataError(
                f"the prompts are chat messages, but the tokenizer of {self.tokenizer_name} has no chat "
                "template to render them with; give a model whose tokenizer has one (chat_template.jinja, or "
                "chat_template in tokenizer_config.json: tokenizer.chat_template = ...; tokenizer.save_pretrained(DIR)), "
                "or plain-text prompts"
            )
        chat = [{"role": message["role"], "content": message["content"]} for message in messages]
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        return str(text)

    def _lengths(self, texts: list[str]) -> list[tuple[int, list[int] | None]]:
        """Each text's length in tokens and, where it is longer than the bound that cuts it
        (``max_prompt_tokens``, else the room with truncate_left or skip), its ids; (0, None)
        where no limit applies. Tokenized in chunks, and only the ids of rows to cut are kept,
        so that a large dataset is never held as ids in full."""
        if not self.limited or self.tokenizer is None or not texts:
            return [(0, None)] * len(texts)
        bound = self.max_prompt_tokens if self.max_prompt_tokens is not None else (
            self.room if self.overlong != "error" else None)
        measured: list[tuple[int, list[int] | None]] = []
        for start in range(0, len(texts), TOKENIZE_CHUNK):
            encoded = self.tokenizer(texts[start:start + TOKENIZE_CHUNK], add_special_tokens=False)["input_ids"]
            measured.extend((len(row), list(row) if bound is not None and len(row) > bound else None)
                            for row in encoded)
        return measured


def check_columns(columns: list[str], answer_key: str, display_name: str, section: str = "data",
                  named: bool = True) -> None:
    """Refuse column names that would clash with the keywords rewards get from flowrl
    (``section``: the pipeline section whose ``answer_key`` applies), and an answer column
    that ``section`` ``named`` itself and the data lacks."""
    clashes = [name for name in columns if name in RESERVED_COLUMNS]
    if answer_key != "answer" and answer_key not in columns and (named or "answer" in columns):
        # a column named on purpose (the default 'answer' may be absent: not every task has one)
        close = difflib.get_close_matches(answer_key, columns, n=1)
        fix = (f"set {section}.answer_key: answer, the column it has" if "answer" in columns else
               f"set {section}.answer_key to the column that holds the reference answers"
               + (f" (did you mean '{close[0]}'?)" if close else "") + ", or leave it out when there are none")
        raise DataError(
            f"{display_name} has no column '{answer_key}' ({section}.answer_key; its columns: "
            f"{', '.join(repr(c) for c in columns)}); {fix}",
            field=f"{section}.answer_key",
        )
    if answer_key != "answer" and "answer" in columns:
        clashes.append("answer")
    if clashes:
        raise DataError(
            f"{display_name} has column{'s' if len(clashes) > 1 else ''} {', '.join(repr(c) for c in clashes)}, "
            f"which reward functions receive from flowrl ({', '.join(RESERVED_COLUMNS)}, and 'answer' for "
            f"the {section}.answer_key column); rename the column, or set {section}.answer_key: answer"
        )


def _chat_problem(messages: list[Any]) -> str | None:
    if not messages:
        return "it is empty"
    for position, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            return f"message {position} is not {{role: str, content: str}} ({_short(message)})"
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _raise_if(problems: list[str], display_name: str, expected: str) -> None:
    raise_listed(problems, "row", display_name, expected)
