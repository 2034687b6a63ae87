"""How local worker processes start: forked from one warm server, or spawned.

Kept apart from ``cluster.py`` (which imports Dask) so that a command can start the server
first thing, before it imports anything heavy itself: the server's imports of torch and
transformers then run beside the command's own.
"""

from __future__ import annotations

import atexit
import hashlib
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.spawn
import os
import shlex
import signal
import tempfile

WARM_PRELOAD = "flowrl.runtime.warm"
"""What every local worker imports before it registers (see ``flowrl.runtime.warm``)."""

_STOPPED_AT_EXIT: list[bool] = []
"""Not empty once :func:`_stop_warm_server` is registered to run at exit."""


def start_warm_server(has_gpus: bool | None = None) -> bool:
    """Start local worker processes by forking a server process that imported torch,
    transformers and the role hosts once (multiprocessing's ``forkserver``), instead of
    spawning fresh interpreters that each import them; True when local workers will fork
    from it. Idempotent: a second call finds the server running.

    On 2 cores, two spawned workers importing torch and transformers side by side with the
    driver took about 3.5 s before they registered, and each kept its own copy of the
    imported modules' memory (about 290 MiB per worker). Forked workers share those pages
    with the server and start in a fraction of a second (a worker the nanny restarts after a
    fault too).

    Only on machines without GPUs (``has_gpus``; None: ask NVML): CUDA cannot be used in a
    process forked from one that initialised it, and what an import initialises is the
    imported library's business.
    """
    _spawn_ignoring_interrupt()  # the server, and spawned workers, start with Ctrl-C ignored
    if has_gpus is None:
        from flowrl.devices.inventory import detect_local

        has_gpus = any(device.kind == "gpu" for device in detect_local(num_cpu_slots=0).devices)
    if has_gpus:
        return False
    set_warm_preload()
    if not _STOPPED_AT_EXIT:
        _STOPPED_AT_EXIT.append(True)
        atexit.register(_stop_warm_server)
    multiprocessing.forkserver.ensure_running()
    return True


def set_warm_preload() -> None:
    """What the fork server imports when it starts (Dask sets its own list once, on first use)."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(["distributed", WARM_PRELOAD])


def _stop_warm_server() -> None:
    """End the fork server when this process exits. Left alone it would notice the exit and
    then spend a second or more finalising torch and transformers, holding the terminal's
    output open after the command returned. Its workers are gone by then: a cluster closes
    before the process exits. Reaping it counts its CPU time (and its workers') as ours."""
    pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def _spawn_ignoring_interrupt() -> None:
    """Start local worker processes with Ctrl-C ignored from their first instruction.

    A terminal sends Ctrl-C to every process of its foreground group, and the driver stops
    the workers in order itself. A worker process that is still starting (a spare, a
    replacement after a fault) would die of it with a traceback on the terminal. Python keeps
    a signal that is ignored when it starts ignored, so worker processes (and the fork server
    they come from) are spawned through a two-line shell script that ignores SIGINT and then
    runs this Python. Workers joined with --scheduler are the user's and keep their own
    signal handling.
    """
    spawn_python = os.fsdecode(multiprocessing.spawn.get_executable())
    if os.path.basename(spawn_python).startswith("flowrl-python-") or not os.path.exists("/bin/sh"):
        return
    digest = hashlib.sha256(spawn_python.encode()).hexdigest()[:12]
    wrapper = os.path.join(tempfile.gettempdir(), f"flowrl-python-{os.getuid()}-{digest}")
    if not os.path.exists(wrapper):
        staging = f"{wrapper}.{os.getpid()}"
        with open(staging, "w") as handle:
            handle.write(f"#!/bin/sh\ntrap '' INT\nexec {shlex.quote(spawn_python)} \"$@\"\n")
        os.chmod(staging, 0o755)
        os.replace(staging, wrapper)
    multiprocessing.spawn.set_executable(wrapper)
