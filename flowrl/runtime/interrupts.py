"""A command stops once: its first stop signal stops it, and the ones after it let that stop
finish.

One Ctrl-C often reaches a process twice, milliseconds apart: a wrapper (``timeout``,
``srun``, ``uv run``) forwards the SIGINT that the terminal also sent to the whole process
group, or the user presses it again. Python's own handler raises KeyboardInterrupt for each;
the second one then lands in the clean-up the first one started (a ``finally`` block, closing
the cluster, an exit handler reaping the fork server) and cuts it short: its bare
``interrupted`` or traceback replaces the message that says where the run stopped and how to
resume it, and what the clean-up left half done can hold the exit up for seconds.

Kept free of heavy imports: the command line sets it up first thing.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

LEAVE_AT = 3
"""The stop signal that makes the command leave at once, the clean-up unfinished: a
clean-up that hangs can always be left (Ctrl-C once more after a doubled one)."""


class _Stop:
    """Whether this process stops at its first stop signal (:func:`stop_at_first_signal`),
    and the name of that signal once it came."""

    enabled = False
    signal: str | None = None
    count = 0
    """Stop signals that came."""


def stop_at_first_signal() -> None:
    """From now on SIGINT raises KeyboardInterrupt, as Python's own handler does, only while
    no stop signal came; later ones are ignored, so that the stop under way cleans up whole
    and says what the first one stopped. SIGTERM (a batch system's preemption, ``kill PID``)
    and SIGHUP (a closed terminal) do the same, where they would have ended the process at
    once: a run stopped by them before its steps says so too (the run loop handles them
    itself while it runs). For a process that stops once and exits (a command line): a
    library's caller keeps Python's handling.

    Only in the main thread, and only in place of Python's own handling: a process started
    with a signal ignored (SIGINT in a shell's background job, SIGHUP under nohup) keeps
    ignoring it."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        _Stop.enabled = True
        signal.signal(signal.SIGINT, _interrupt_once)
    for name in ("SIGTERM", "SIGHUP"):
        number = getattr(signal, name, None)
        if number is not None and signal.getsignal(number) is signal.SIG_DFL:
            _Stop.enabled = True
            signal.signal(number, _interrupt_once)


def exit_code() -> int:
    """128 + the number of the stop signal that came, as a shell reports a process it ended
    (130 when none did: Ctrl-C's)."""
    name = _Stop.signal or "SIGINT"
    return 128 + int(getattr(signal, name, signal.SIGINT))


def note_stop_signal(name: str) -> None:
    """A handler of its own (the run loop's) took the stop signal ``name``: the signals after
    it leave the stop alone too once that handler hands SIGINT back."""
    if _Stop.enabled and _Stop.signal is None:
        _Stop.signal = name
        _Stop.count = 1


def repeated_signal() -> None:
    """Another stop signal while the stop runs: nothing, so that it cleans up whole, until
    the :data:`LEAVE_AT`-th, which ends the command at once (exit code 130)."""
    if not _Stop.enabled:
        return
    _Stop.count += 1
    if _Stop.count >= LEAVE_AT:
        os.write(2, b"\nstopped at once (a third stop signal): the clean-up was left unfinished\n")
        os._exit(130)


def stopping_for() -> str | None:
    """The stop signal this process is stopping for; None while none came, and always where
    the process keeps Python's handling. A KeyboardInterrupt swallowed on the way (C code that
    clears Python errors) stops the process all the same: with later SIGINTs ignored, nothing
    else would."""
    return _Stop.signal


def _interrupt_once(signum: int, frame: Any) -> None:
    if _Stop.signal is not None:
        repeated_signal()  # the stop is under way: an exception now would cut its clean-up short
        return
    _Stop.signal = signal.Signals(signum).name
    _Stop.count = 1
    raise KeyboardInterrupt
