"""make_reporter picks the live view only for a terminal."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from flowrl.records import RunEvent
from flowrl.ui import LiveView, PlainLog, make_reporter


def console_for(is_terminal: bool, file: io.StringIO | None = None) -> Console:
    return Console(file=file or io.StringIO(), force_terminal=is_terminal, color_system=None)


@pytest.mark.parametrize(
    ("is_terminal", "plain", "expected"),
    [
        (True, None, LiveView),
        (True, False, LiveView),
        (True, True, PlainLog),
        (False, None, PlainLog),
        (False, False, PlainLog),  # a live view in a pipe would show only its last frame
    ],
)
def test_choice(is_terminal: bool, plain: bool | None, expected: type) -> None:
    reporter = make_reporter(console_for(is_terminal), plain, "grpo-digits", 10)
    assert isinstance(reporter, expected)


def test_plain_log_writes_to_the_console_file() -> None:
    out = io.StringIO()
    with make_reporter(console_for(False, out), None, "grpo-digits", 10) as reporter:
        reporter.on_event(RunEvent("checkpoint", "saved outputs/run/final"))
    assert out.getvalue() == "[event] checkpoint: saved outputs/run/final\n"
