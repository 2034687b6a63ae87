"""A rich live view of a run, redrawn in place while the run goes on.

::

    grpo-digits   step 12/120   ━━━╺━━━━━━━━━━━━━━━━━━━━   elapsed 6s   eta 9s
    reward 0.41 ▁▃▅█   resp_len 16.0   step 0.084s   1,520 tok/s
    step 10  checkpoint: saved outputs/run/step-10
    last warning (step 7): reward: 3 of 32 samples failed: ValueError: ...
     node     role      device   latency   tok/s   wait
     gen      generate  cpu:0       31ms   1,200    2ms
     ...
     device   kind   util   memory
     cpu:0    cpu     75%   1.2 GB
     ...

State changes only in ``on_step`` / ``on_event``; ``render`` is a pure function of that
state and of ``clock``, so a test renders it into a recording console and reads the text.
Redrawing is left to rich's refresh thread at ``REFRESHES_PER_S``: a step that reports
faster than that costs no extra drawing, and elapsed time and ETA keep moving during a
long step.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from types import TracebackType

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from flowrl.records import RunEvent, StepRecord
from flowrl.ui.format import (
    format_duration,
    format_gb,
    format_ms,
    format_number,
    format_percent,
    format_seconds,
    format_tokens_per_s,
    sparkline,
)
from flowrl.ui.progress import (
    NUM_FAILED_KEY,
    RESPONSE_LENGTH_KEY,
    REWARD_KEY,
    STEP_TIME_KEY,
    THROUGHPUT_KEY,
    EtaEstimator,
    failed_shares,
)

REFRESHES_PER_S = 4.0
"""Upper bound on redraws per second."""
NUM_SPARK_STEPS = 20
"""Recent steps drawn in the reward sparkline."""
NUM_EVENTS_SHOWN = 5
"""Most recent events listed (above the tables)."""
PROGRESS_BAR_WIDTH = 30
"""Progress bar width in characters."""

_EVENT_STYLES = {
    "warning": "yellow",
    "error": "bold red",
    "fault": "bold red",
    "recovered": "green",
    "checkpoint": "green",
    "placement": "cyan",
}


class LiveView:
    """Live view of one run; use as a context manager around the training loop."""

    def __init__(
        self,
        pipeline_name: str,
        num_steps: int,
        console: Console,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pipeline_name = pipeline_name
        self.num_steps = num_steps
        self._console = console
        self._clock = clock
        # The refresh thread renders while the run thread reports; one lock keeps
        # `render` from reading a half-updated state.
        self._lock = threading.Lock()
        self._started_s = clock()
        self._last: StepRecord | None = None
        self._last_received_s = self._started_s
        self._rewards: deque[float] = deque(maxlen=NUM_SPARK_STEPS)
        self._events: deque[RunEvent] = deque(maxlen=NUM_EVENTS_SHOWN)
        self._eta = EtaEstimator()
        self._live: Live | None = None
        self._validation: dict[str, float] = {}
        """The newest evaluation's ``val/<score>/mean`` values (evaluations are sparse)."""
        self._validation_step: int | None = None
        self._warning: RunEvent | None = None
        """The newest warning: it stays on screen after newer events push it out of the list."""

    # -- state -----------------------------------------------------------------------

    def on_step(self, record: StepRecord) -> None:
        """Take in a finished step; the next refresh shows it."""
        with self._lock:
            self._last = record
            self._last_received_s = self._clock()
            self._eta.add(record.step, record.process_s, record.first_step)
            if REWARD_KEY in record.metrics:
                self._rewards.append(record.metrics[REWARD_KEY])

    def on_event(self, event: RunEvent) -> None:
        """Take in an event; only the last ``NUM_EVENTS_SHOWN`` are kept."""
        with self._lock:
            self._events.append(event)
            if event.kind == "warning":
                self._warning = event
            if event.kind == "eval":
                self._validation_step = event.step
                metrics = event.data.get("metrics", {})
                self._validation = {
                    key.removesuffix("/mean"): value for key, value in metrics.items()
                    if key.endswith("/mean") and not key.startswith("val/response_length")
                }

    # -- drawing ---------------------------------------------------------------------

    def render(self) -> RenderableType:
        """The whole view as one renderable, from the current state and clock."""
        with self._lock:
            parts: list[RenderableType] = [self._header(), self._summary()]
            # the events before the tables: a terminal too short for all of it cuts the
            # bottom, and a fault or a move must not be what is cut
            if self._events:
                parts.append(self._event_lines())
            if self._warning is not None and self._warning not in self._events:
                where = f" (step {self._warning.step})" if self._warning.step is not None else ""
                parts.append(Text(f"last warning{where}: {self._warning.message}", style="yellow"))
            if self._last is None:
                parts.append(Text("waiting for the first step", style="dim"))
            else:
                parts.append(self._node_table(self._last))
                parts.append(self._device_table(self._last))
            return Group(*parts)

    def _elapsed_s(self) -> float:
        """Seconds since the view started (the command's start-up included) or, if more, the
        last step's time in this process and since: never less than a moment ago (the run's
        clock starts after the cluster does, and read alone it went back at step 1)."""
        now_s = self._clock()
        shown = now_s - self._started_s
        if self._last is not None:
            shown = max(shown, self._last.process_s + (now_s - self._last_received_s))
        return shown

    def _header(self) -> Table:
        step = self._last.step if self._last is not None else 0
        since_last_s = self._clock() - self._last_received_s
        eta_s = self._eta.eta_s(self.num_steps, since_last_s)
        header = Table.grid(padding=(0, 3))
        header.add_row(
            Text(self.pipeline_name, style="bold"),
            Text(f"step {step}/{self.num_steps}"),
            ProgressBar(total=max(self.num_steps, 1), completed=step, width=PROGRESS_BAR_WIDTH),
            Text(f"elapsed {format_duration(self._elapsed_s())}"),
            Text(f"eta {format_duration(eta_s)}"),
        )
        return header

    def _summary(self) -> Text:
        metrics = self._last.metrics if self._last is not None else {}
        reward = f"reward {format_number(metrics.get(REWARD_KEY), 2)}"
        if self._rewards:
            reward += " " + sparkline(list(self._rewards), NUM_SPARK_STEPS)
        parts = [
            reward,
            f"resp_len {format_number(metrics.get(RESPONSE_LENGTH_KEY), 1)}",
            f"step {format_seconds(metrics.get(STEP_TIME_KEY))}",
            format_tokens_per_s(metrics.get(THROUGHPUT_KEY)),
        ]
        if self._validation:
            # evaluations are sparse: say which step the numbers are from
            parts.append(f"eval@{self._validation_step} " + "  ".join(
                f"{key} {format_number(value, 3)}" for key, value in self._validation.items()))
        summary = Text("   ".join(parts))
        shares = failed_shares(metrics)
        if None in shares:
            count = metrics.get(NUM_FAILED_KEY)
            samples = f"{count:.0f} samples, " if count is not None else ""
            summary.append(f"   reward failed: {samples}{shares[None]:.0%}", style="bold red")
        for node, share in shares.items():
            if node is not None:
                summary.append(f"   {node} failed: {share:.0%}", style="bold red")
        return summary

    @staticmethod
    def _node_table(record: StepRecord) -> Table:
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
        table.add_column("node", style="bold")
        table.add_column("role")
        table.add_column("device")
        table.add_column("wall", justify="right")
        table.add_column("compute", justify="right")
        table.add_column("wait", justify="right")
        table.add_column("tok/s", justify="right")
        for node in record.nodes:
            table.add_row(
                node.node,
                node.role,
                node.device,
                format_ms(node.wall_s),
                format_ms(node.compute_s),
                format_ms(node.wait_s),
                f"{node.tokens_per_s:,.0f}",
            )
        return table

    @staticmethod
    def _device_table(record: StepRecord) -> Table:
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
        table.add_column("device", style="bold")
        table.add_column("kind")
        table.add_column("util", justify="right")
        table.add_column("memory", justify="right")
        for device in record.devices:
            table.add_row(
                device.device,
                device.kind,
                format_percent(device.utilization),
                format_gb(device.memory_gb, device.memory_total_gb),
            )
        return table

    def _event_lines(self) -> Text:
        lines = Text()
        for index, event in enumerate(self._events):
            if index:
                lines.append("\n")
            where = f"step {event.step}  " if event.step is not None else ""
            lines.append(f"{where}{event.kind}: ", style=_EVENT_STYLES.get(event.kind, "bold"))
            lines.append(event.message)
        return lines

    # -- context manager -------------------------------------------------------------

    def __enter__(self) -> LiveView:
        with self._lock:
            self._started_s = self._clock()
            self._last_received_s = self._started_s
        self._live = Live(
            console=self._console,
            get_renderable=self.render,
            refresh_per_second=REFRESHES_PER_S,
        )
        self._live.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._live is not None:
            # Stopping draws the final state once more, so it stays on screen.
            self._live.__exit__(exc_type, exc, traceback)
            self._live = None
