"""What a person watching a run sees: a rich live view on a terminal, plain lines elsewhere.

``make_reporter`` picks one; both take the same ``StepRecord`` and ``RunEvent`` records.
"""

from __future__ import annotations

from types import TracebackType
from typing import Protocol

from rich.console import Console

from flowrl.records import RunEvent, StepRecord
from flowrl.ui.live import LiveView
from flowrl.ui.plain import PlainLog

__all__ = ["LiveView", "PlainLog", "Reporter", "make_reporter"]


class Reporter(Protocol):
    """Anything that shows a run's steps and events; entered for the run's whole length."""

    def on_step(self, record: StepRecord) -> None:
        """Show a finished step."""
        ...

    def on_event(self, event: RunEvent) -> None:
        """Show an event (placement, checkpoint, warning)."""
        ...

    def __enter__(self) -> Reporter: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None: ...


def make_reporter(
    console: Console, plain: bool | None, pipeline_name: str, num_steps: int
) -> Reporter:
    """A ``LiveView`` when ``console`` is a terminal and ``plain`` is not set, else a ``PlainLog``.

    ``plain=None`` and ``plain=False`` both mean "live if possible": a live view written
    to a file or pipe would only show its last frame, so a non-terminal always gets plain
    lines. The plain log writes to the console's own file.
    """
    if console.is_terminal and not plain:
        return LiveView(pipeline_name, num_steps, console)
    return PlainLog(console.file)
