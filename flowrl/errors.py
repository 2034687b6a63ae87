"""Every error flowrl raises on purpose.

A ``FlowrlError`` is a user error: the CLI prints its message (no traceback) and exits
with code 2. Its message says what was expected, what was found and what to do.
Anything else that escapes is a bug in flowrl.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


class FlowrlError(Exception):
    """A mistake in what the user gave flowrl (file, flag, data, environment)."""

    exit_code: int = 2

    def __reduce__(self) -> tuple[Any, ...]:
        # whole, with the attributes its own __init__ sets (``field``, ``slots``...), where a
        # run goes through pickle (a run in a process pool); Exception's default would call
        # a subclass's __init__ with the message alone
        return _rebuilt, (type(self), self.args, self.__dict__)


def _rebuilt(kind: type[FlowrlError], args: tuple[Any, ...], state: dict[str, Any]) -> FlowrlError:
    error = kind.__new__(kind)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


@dataclass(frozen=True)
class SpecIssue:
    """One problem in a pipeline (or inventory) description.

    ``path`` is the dotted place in the document (``nodes.rollout.model``); ``file`` and
    ``line`` are known when the document came from a file. ``argument`` is the command-line
    override (``trainer.steps=abc``) the problem comes from, when it is not the file's.
    """

    path: str
    message: str
    file: str | None = None
    line: int | None = None
    argument: str | None = None

    def __str__(self) -> str:
        place = f"{self.path}: " if self.path else ""
        if self.argument is not None:
            if self.argument.partition("=")[0].strip() == self.path:
                place = ""  # the argument already names the path
            return f"{self.file or 'command line'}: {self.argument}: {place}{self.message}"
        where = ""
        if self.file is not None:
            where = f"{self.file}:{self.line}: " if self.line is not None else f"{self.file}: "
        return f"{where}{place}{self.message}"


class SpecError(FlowrlError):
    """A description (pipeline, inventory, scenario) with one or more problems; all listed."""

    subject = "the pipeline"
    """What the issues are in, for the message's first line; subclasses name their file kind."""

    def __init__(self, issues: list[SpecIssue]) -> None:
        self.issues = list(issues)
        count = len(self.issues)
        header = f"{count} problem{'s' if count != 1 else ''} in {self.subject}:"
        super().__init__("\n".join([header, *(f"  {issue}" for issue in self.issues)]))


class DataError(FlowrlError):
    """A dataset that cannot be read (file missing, bad line). ``field``: the pipeline field
    at fault when it is not the source itself (``data.prompt_key``), so that the message is
    placed at that field's line, or at the command-line override that set it."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.also: list[DataError] = []
        """Problems found beside this one (each placed at its own field), for a report of all."""


class ModelLoadError(FlowrlError):
    """A model or tokenizer that cannot be loaded (missing directory, offline hub name).
    ``field``: the pipeline field it is placed at when known (as :class:`DataError`'s)."""

    field: str | None = None


class RemoteCodeNotTrusted(ModelLoadError):
    """A model that needs its own Python code, loaded without ``trust_remote_code: true``."""


class PlacementError(FlowrlError):
    """The device groups cannot be placed on the devices that exist."""


class UnmatchedGroups(PlacementError):
    """Device groups no devices satisfy. ``problems``: (pipeline field, message) of each, so
    that a command that read the pipeline from a file places them at its lines."""

    def __init__(self, message: str, problems: list[tuple[str, str]]) -> None:
        super().__init__(message)
        self.problems = problems



class ClusterError(FlowrlError):
    """The Dask cluster cannot be started or reached, or lost the workers a run needs."""


class NodeTimeout(ClusterError):
    """A node ran past ``runtime.node_timeout_s``: its worker counts as hung. ``node``: the
    node whose call it was, where one call is known. ``collective``: a rank of the node's
    group failed in a collective because another rank died or stopped answering (the slots
    are the whole group; which of them is at fault is not known yet)."""

    def __init__(self, message: str, slots: tuple[str, ...], node: str | None = None,
                 collective: bool = False) -> None:
        super().__init__(message)
        self.slots = slots
        self.node = node
        self.collective = collective



class WorkerLost(ClusterError):
    """Workers that a call waited on left the scheduler (killed, crashed, their machine gone)."""

    def __init__(self, message: str, slots: tuple[str, ...]) -> None:
        super().__init__(message)
        self.slots = slots



class RunStopped(ClusterError):
    """A run stopped by faults it may not survive (``runtime.max_recoveries``): not the
    user's mistake, so the exit code is 1; the message names the checkpoint to resume from."""

    exit_code = 1


class RewardError(FlowrlError):
    """A reward function that cannot be resolved, or that failed in strict mode."""


class CheckpointError(FlowrlError):
    """A checkpoint that cannot be written or read."""


def error_chain(error: BaseException) -> Iterator[BaseException]:
    """``error``, then the errors it was raised from or while handling, newest first."""
    link: BaseException | None = error
    while link is not None:
        yield link
        link = link.__cause__ or link.__context__


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM, SIGHUP) stopped a run; the message says where, what was kept and
    how to go on. ``exit_code``: 128 + the signal's number, as a shell reports a process
    ended by it (130 for Ctrl-C)."""

    def __init__(self, message: str, signal_name: str = "SIGINT") -> None:
        super().__init__(message)
        import signal

        self.exit_code = 128 + int(getattr(signal, signal_name, signal.SIGINT))
