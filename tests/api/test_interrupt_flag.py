"""Ctrl-C during a run: raised as KeyboardInterrupt and remembered, so a swallowed one still stops it."""

from __future__ import annotations

import os
import signal

import pytest

from flowrl.api.driver import _InterruptFlag


@pytest.fixture(autouse=True)
def python_handles_sigint() -> object:
    """Python's own Ctrl-C handler, as in a terminal, whatever started the tests (a shell
    starts background jobs with SIGINT ignored, and Python then installs no handler)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


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
