"""Ctrl-C during a run: raised as KeyboardInterrupt and remembered, so a swallowed one still stops it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowrl.api.driver import _InterruptFlag
from flowrl.runtime import interrupts
from flowrl.runtime.interrupts import stop_at_first_signal, stopping_for


@pytest.fixture(autouse=True)
def python_handles_sigint(monkeypatch: pytest.MonkeyPatch) -> object:
    """Python's own Ctrl-C handler, as in a terminal, whatever started the tests (a shell
    starts background jobs with SIGINT ignored, and Python then installs no handler); no stop
    under way, and Python's handling kept as by a library's caller until a test asks for a
    command's."""
    monkeypatch.setattr(interrupts._Stop, "enabled", False)
    monkeypatch.setattr(interrupts._Stop, "signal", None)
    monkeypatch.setattr(interrupts._Stop, "count", 0)
    monkeypatch.setattr(interrupts._Stop, "owed", False)
    monkeypatch.setattr(interrupts._Stop, "retrying", False)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    others = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGHUP)}
    yield
    signal.signal(signal.SIGINT, before)
    for number, handler in others.items():  # a command's handlers set by a test
        signal.signal(number, handler)


def test_sigint_raises_and_is_remembered_even_when_the_exception_is_swallowed() -> None:
    before = signal.getsignal(signal.SIGINT)
    with _InterruptFlag() as flag:
        assert not flag.raised
        raised = False
        try:
            with flag.armed():
                os.kill(os.getpid(), signal.SIGINT)  # the handler runs as soon as kill returns
        except KeyboardInterrupt:
            raised = True  # as C code that clears Python errors would swallow it
        assert flag.raised and raised
    assert signal.getsignal(signal.SIGINT) is before


def test_a_held_block_finishes_before_the_signal_raises() -> None:
    """A step's record goes to metrics.jsonl, the terminal and the trackers in one block: a
    Ctrl-C between them left the step in the file and out of the trackers."""
    done = []
    with _InterruptFlag() as flag:
        with pytest.raises(KeyboardInterrupt):
            with flag.armed():
                with flag.held():
                    os.kill(os.getpid(), signal.SIGINT)
                    done.append("rest of the block")
                done.append("after the block")
    assert done == ["rest of the block"] and flag.raised


def test_between_instructions_sigint_is_only_remembered() -> None:
    """A KeyboardInterrupt between two instructions would escape the loop that turns it into
    the run's stop (the run ended saying only 'interrupted')."""
    with _InterruptFlag() as flag:
        os.kill(os.getpid(), signal.SIGINT)
        assert flag.raised


def test_an_ignored_sigint_stays_ignored() -> None:
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with _InterruptFlag() as flag:
            os.kill(os.getpid(), signal.SIGINT)
        assert not flag.raised
    finally:
        signal.signal(signal.SIGINT, before)


def test_sigint_outside_the_block_is_python_s_again() -> None:
    with _InterruptFlag():
        pass
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP"])
def test_sigterm_and_sighup_stop_the_run_as_ctrl_c_does_and_are_named(name: str) -> None:
    """A batch system's preemption (SIGTERM) or a closed terminal (SIGHUP) ended the process
    at once, saying nothing; now the run stops where it is and says how to resume."""
    number = getattr(signal, name)
    # as in a terminal, whatever started the tests (nohup starts them with SIGHUP ignored,
    # which the flag then keeps ignoring)
    before = signal.signal(number, signal.SIG_DFL)
    try:
        with _InterruptFlag() as flag:
            with pytest.raises(KeyboardInterrupt):
                with flag.armed():
                    os.kill(os.getpid(), number)
            os.kill(os.getpid(), signal.SIGINT)  # a second signal: the first one names the stop
            assert flag.raised and flag.signal == name
        assert signal.getsignal(number) is signal.SIG_DFL
    finally:
        signal.signal(number, before)


def test_an_interrupted_run_exits_as_a_shell_reports_the_signal() -> None:
    from flowrl.errors import RunInterrupted

    assert RunInterrupted("stopped").exit_code == 130
    assert RunInterrupted("stopped", "SIGTERM").exit_code == 143


def test_a_command_stops_once_and_the_sigints_after_the_first_leave_its_stop_alone() -> None:
    """A wrapper forwards the Ctrl-C the terminal also sent, or the user presses it twice: the
    second SIGINT came during the clean-up the first one started and cut it short with a
    traceback, in place of the message that says where the run stopped."""
    stop_at_first_signal()
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGINT)  # as in a `finally` block or an exit handler: nothing raised
    assert stopping_for() == "SIGINT"


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_a_stop_signal_the_run_loop_took_counts_for_the_command(name: str) -> None:
    """The loop's own handler hands SIGINT back when the run stops; a SIGINT during the clean-up
    that follows turned the interrupt's message into a bare 'interrupted'."""
    number = getattr(signal, name)
    before = signal.getsignal(number)
    if number != signal.SIGINT:  # as in a terminal, whatever started the tests
        signal.signal(number, signal.SIG_DFL)
    try:
        stop_at_first_signal()
        with _InterruptFlag() as flag:
            with pytest.raises(KeyboardInterrupt):
                with flag.armed():
                    os.kill(os.getpid(), number)
        os.kill(os.getpid(), signal.SIGINT)
        assert flag.signal == name and stopping_for() == name
    finally:
        signal.signal(number, before)


def test_an_interrupt_swallowed_before_the_loop_still_stops_the_run() -> None:
    """The Ctrl-Cs after the first are ignored, so a first one whose KeyboardInterrupt never
    got out (C code that clears Python errors) must stop the run by itself."""
    stop_at_first_signal()
    try:
        os.kill(os.getpid(), signal.SIGINT)
    except KeyboardInterrupt:
        pass
    with _InterruptFlag() as flag:
        assert flag.raised and flag.signal == "SIGINT"


def test_a_library_caller_keeps_python_s_sigint_handling() -> None:
    """run() called from a script or a notebook: the next Ctrl-C interrupts as ever, and a next
    run starts without a stop."""
    with _InterruptFlag() as flag:
        os.kill(os.getpid(), signal.SIGINT)
    assert flag.raised
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
    with _InterruptFlag() as again:
        assert not again.raised
    assert stopping_for() is None


def test_a_command_started_with_sigint_ignored_keeps_ignoring_it() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop_at_first_signal()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    os.kill(os.getpid(), signal.SIGINT)
    assert stopping_for() is None


def test_while_an_instruction_runs_only_the_first_signal_raises() -> None:
    """A forwarded duplicate milliseconds after the first would raise again inside the
    except block that cleans up after the first (a checkpoint's staging folder)."""
    with _InterruptFlag() as flag:
        with pytest.raises(KeyboardInterrupt):
            with flag.armed():
                os.kill(os.getpid(), signal.SIGINT)
        with flag.armed():
            os.kill(os.getpid(), signal.SIGINT)  # nothing raised
        assert flag.raised and flag.signal == "SIGINT"


def test_the_third_stop_signal_leaves_the_command_at_once() -> None:
    """A clean-up that hangs can always be left: Ctrl-C once more after a doubled one."""
    import subprocess
    import sys

    code = ("import os, signal, time\n"
            "from flowrl.runtime.interrupts import stop_at_first_signal\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "stop_at_first_signal()\n"
            "try:\n    os.kill(os.getpid(), signal.SIGINT)\nexcept KeyboardInterrupt:\n    print('stopping', flush=True)\n"
            "os.kill(os.getpid(), signal.SIGINT)\nprint('second ignored', flush=True)\n"
            "os.kill(os.getpid(), signal.SIGINT)\ntime.sleep(5)\nprint('not reached', flush=True)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 130
    assert done.stdout.split() == ["stopping", "second", "ignored"]
    assert "stopped at once (a third stop signal)" in done.stderr


@pytest.mark.parametrize(("name", "code"), [("SIGTERM", 143), ("SIGHUP", 129)])
def test_a_command_stops_once_for_sigterm_and_sighup_too(name: str, code: int) -> None:
    """Before the run loop takes them (reading the data, starting the cluster) they ended the
    process without a word; now the first raises, the next are ignored, and the exit code is
    the shell's for that signal."""
    number = getattr(signal, name)
    signal.signal(number, signal.SIG_DFL)  # as in a terminal, whatever started the tests
    stop_at_first_signal()
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), number)
    os.kill(os.getpid(), number)  # ignored while the stop cleans up
    assert stopping_for() == name and interrupts.exit_code() == code


def test_a_command_started_with_sighup_ignored_keeps_ignoring_it() -> None:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    stop_at_first_signal()
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN


def _command(tmp_path: Path, module_body: str, main: str) -> subprocess.CompletedProcess[str]:
    """Run ``main`` as a command (stopping at its first signal) beside a module ``slow`` whose
    body is ``module_body``."""
    (tmp_path / "slow.py").write_text(module_body)
    code = ("import os, signal, sys, time\n"
            "from flowrl.runtime.interrupts import stop_at_first_signal\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            f"stop_at_first_signal()\nsys.path.insert(0, {str(tmp_path)!r})\n" + main)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)


def test_a_signal_during_an_import_is_raised_once_the_import_is_over(tmp_path: Path) -> None:
    """Raised inside an import, the KeyboardInterrupt left half-initialised modules (a later
    import of torch aborted the process) or was dropped by the import machinery's callbacks
    (the command went on after the Ctrl-C)."""
    done = _command(
        tmp_path,
        "import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(0.2)\nWHOLE = True\n",
        # the wait after the import is cut short too (the command would not stop for a minute)
        "try:\n    import slow\n    print('imported', slow.WHOLE, flush=True)\n    time.sleep(60)\n"
        "    print('not interrupted', flush=True)\nexcept KeyboardInterrupt:\n"
        "    print('interrupted', 'slow' in sys.modules, flush=True)\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["imported", "True", "interrupted", "True"]


def test_in_the_run_loop_a_signal_during_an_import_is_raised_once_it_is_over(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "slow_in_loop.py").write_text("import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\n"
                                              "time.sleep(0.2)\nWHOLE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with _InterruptFlag() as flag:
        with pytest.raises(KeyboardInterrupt):
            with flag.armed():
                import slow_in_loop  # noqa: F401
                time.sleep(60)
    assert flag.raised and sys.modules["slow_in_loop"].WHOLE
    assert not interrupts.owed()


def test_the_third_stop_signal_during_an_import_still_leaves_at_once(tmp_path: Path) -> None:
    """An import that hangs can be left as a clean-up that hangs can."""
    body = "import os, signal, time\n" + "os.kill(os.getpid(), signal.SIGINT)\ntime.sleep(0.1)\n" * 3 + \
        "time.sleep(10)\nprint('not reached', flush=True)\n"
    done = _command(tmp_path, body, "import slow\n")
    assert done.returncode == 130
    assert "stopped at once (a third stop signal)" in done.stderr and "not reached" not in done.stdout
