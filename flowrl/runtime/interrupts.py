"""A command stops once: its first stop signal stops it, and the ones after it let that stop
finish.

One Ctrl-C often reaches a process twice, milliseconds apart: a wrapper (``timeout``,
``srun``, ``uv run``) forwards the SIGINT that the terminal also sent to the whole process
group, or the user presses it again. Python's own handler raises KeyboardInterrupt for each;
the second one then lands in the clean-up the first one started (a ``finally`` block, closing
the cluster, an exit handler reaping the fork server) and cuts it short: its bare
``interrupted`` or traceback replaces the message that says where the run stopped and how to
resume it, and what the clean-up left half done can hold the exit up for seconds.

A stop signal that comes while the main thread imports a module is raised once the import
is over. Raised inside one, the KeyboardInterrupt leaves a half-initialised module behind (a
later import of torch aborted the process: "cannot initialize type GradBucket: an object with
that name is already defined"), or lands in a callback of the import machinery that drops it
(the command then went on after the Ctrl-C).

Kept free of heavy imports: the command line sets it up first thing.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

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
    owed = False
    """The first signal's KeyboardInterrupt waits for the import under way to end."""
    retrying = False
    """The next call of the handler is a retry of the owed KeyboardInterrupt, not a signal."""


RETRY_S = 0.02
"""How often an owed KeyboardInterrupt is tried again while an import runs."""


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


def handed_over() -> None:
    """Another handler takes the stop signals from now on, or hands them back: an owed
    KeyboardInterrupt is no longer retried (``stopping_for`` tells a run loop's handler of
    the signal that came)."""
    _Stop.owed = False


def took_retry() -> bool:
    """Whether the signal being handled is a retry of an owed KeyboardInterrupt
    (:func:`raise_outside_imports`), not one from anyone stopping the process."""
    retry, _Stop.retrying = _Stop.retrying, False
    return retry


def owed() -> bool:
    """Whether a KeyboardInterrupt waits for an import to end."""
    return _Stop.owed


def raise_outside_imports(signum: int, frame: FrameType | None, retry: bool) -> None:
    """Raise KeyboardInterrupt, unless ``frame`` runs inside an import: then it is owed, and
    the handler of ``signum`` is called again shortly (``retry``: this call is such a
    retry, and the next one is due)."""
    if not importing(frame):
        _Stop.owed = False
        raise KeyboardInterrupt
    if retry or not _Stop.owed:  # else a retry is pending already
        _Stop.owed = True
        timer = threading.Timer(RETRY_S, _retry, args=(signum,))
        timer.daemon = True
        timer.start()


def _interrupt_once(signum: int, frame: FrameType | None) -> None:
    retry = took_retry()
    if retry and not _Stop.owed:
        return  # the owed KeyboardInterrupt was raised already, or handed over
    if _Stop.signal is None:
        _Stop.signal = signal.Signals(signum).name
        _Stop.count = 1
    elif not retry:
        repeated_signal()  # the stop is under way: an exception now would cut its clean-up short
        if not _Stop.owed:
            return
    raise_outside_imports(signum, frame, retry)  # the first signal, or its KeyboardInterrupt still owed


def _retry(signum: int) -> None:
    """From a timer's thread: signal the main thread again while the KeyboardInterrupt is
    owed. A real signal, not a flag the interpreter looks at between instructions: that would
    wait for whatever the main thread waits in (a sleep, a socket) to end."""
    if not _Stop.owed:
        return
    _Stop.retrying = True
    signal.pthread_kill(threading.main_thread().ident or 0, signum)


def importing(frame: FrameType | None) -> bool:
    """Whether ``frame`` runs inside an import: a module's body or the import machinery."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False
