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
