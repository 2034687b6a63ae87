"""One line per step, for logs and pipes (stdout that is not a terminal).

::

    step 12/120 | reward 0.41 | resp_len 16.0 | step 0.084s | gen 31ms | 1,520 tok/s | eta 9s
    [event] checkpoint: saved outputs/run/step-12

A part whose metric the step did not report is left out rather than shown empty, so
lines stay short and ``grep``-able.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from types import TracebackType
from typing import IO

from flowrl.records import RunEvent, StepRecord
from flowrl.ui.format import (
    format_duration,
    format_ms,
    format_number,
    format_seconds,
    format_tokens_per_s,
)
from flowrl.ui.progress import (
    RESPONSE_LENGTH_KEY,
    REWARD_KEY,
    STEP_TIME_KEY,
    THROUGHPUT_KEY,
    EtaEstimator,
    failed_shares,
)


def format_step_line(record: StepRecord, eta_s: float | None) -> str:
    """The log line of one step (pure, so tests and other writers can reuse it)."""
    metrics = record.metrics
    parts = [f"step {record.step}/{record.num_steps}"]
    if REWARD_KEY in metrics:
        parts.append(f"reward {format_number(metrics[REWARD_KEY], 2)}")
    for node, share in failed_shares(metrics).items():
        parts.append(f"failed {share:.0%}" if node is None else f"{node} failed {share:.0%}")
    validation = [(key, value) for key, value in metrics.items() if key.startswith("val/") and key.endswith("/mean")
                  and not key.startswith("val/response_length")]
    if validation:
        parts.append(" ".join(f"{key.removesuffix('/mean')} {format_number(value, 3)}" for key, value in validation))
    if RESPONSE_LENGTH_KEY in metrics:
        parts.append(f"resp_len {format_number(metrics[RESPONSE_LENGTH_KEY], 1)}")
    if STEP_TIME_KEY in metrics:
        parts.append(f"step {format_seconds(metrics[STEP_TIME_KEY])}")
    if record.nodes:
        # compute time: a node's wall time also counts its wait for its inputs
        parts.append(" ".join(f"{name} {_compute_range(times)}" for name, times in _node_compute_s(record).items()))
    if THROUGHPUT_KEY in metrics:
        parts.append(format_tokens_per_s(metrics[THROUGHPUT_KEY]))
    parts.append(f"eta {format_duration(eta_s)}")
    return " | ".join(parts)


def _node_compute_s(record: StepRecord) -> dict[str, list[float]]:
    """Compute seconds by node in the step's order: a node split over devices has one per part."""
    times: dict[str, list[float]] = {}
    for node in record.nodes:
        times.setdefault(node.node, []).append(node.compute_s)
    return times


def _compute_range(times: list[float]) -> str:
    """``38ms`` for one part, ``30-38ms`` from the fastest to the slowest of a split node's."""
    low, high = format_ms(min(times)), format_ms(max(times))
    return high if low == high else f"{low.removesuffix('ms')}-{high}"


def format_event_line(event: RunEvent) -> str:
    """The log line of one event: ``[event] kind: message``."""
    return f"[event] {event.kind}: {event.message}"


class PlainLog:
    """Writes one line per step and per event to ``stream``, flushing each.

    ``clock`` stands in for ``record.elapsed_s`` when a producer leaves it at 0 (records
    built without timing): the run's elapsed time is then measured from this object's
    creation.
    """

    def __init__(self, stream: IO[str], clock: Callable[[], float] = time.monotonic) -> None:
        self._stream = stream
        self._closed = False
        self._clock = clock
        self._started_s = clock()
        self._eta = EtaEstimator()

    def on_step(self, record: StepRecord) -> None:
        """Log a finished step."""
        elapsed_s = record.process_s if record.process_s > 0 else self._clock() - self._started_s
        self._eta.add(record.step, elapsed_s, record.first_step)
        self._write(format_step_line(record, self._eta.eta_s(record.num_steps)))

    def on_event(self, event: RunEvent) -> None:
        """Log an event as it happens. Why a run stopped (an error, an interrupt) is what ``flowrl`` prints next:
        the log says only where, so that the reason is printed once."""
        if event.kind == "stopped":
            # the last finished step: the error names the step that was running
            where = f"after step {event.step}" if event.step else "before any step finished"
            self._write(f"[event] stopped {where} (the reason follows)")
        else:
            self._write(format_event_line(event))

    def __enter__(self) -> PlainLog:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._stream.flush()

    def _write(self, line: str) -> None:
        if self._closed:
            return
        try:
            self._stream.write(line + "\n")
            # Flushed per line so `tail -f` and CI logs show progress as it happens.
            self._stream.flush()
        except BrokenPipeError:
            # The reader went away (`flowrl run ... | head`): the run goes on, its files keep
            # every line; what this stream would still get goes nowhere.
            self._closed = True
            drop_stream(self._stream)


def drop_stream(stream: IO[str]) -> None:
    """Point a closed pipe's file descriptor at /dev/null, so that later writes and the
    interpreter's last flush do not fail on it again."""
    try:
        descriptor = stream.fileno()
    except (OSError, ValueError):
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, descriptor)
    finally:
        os.close(null)
