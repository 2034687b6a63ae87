"""Every remote call the driver waits on has a deadline and notices a lost worker at once.

A Dask future of a task pinned to a worker that died never finishes (the task waits for a
worker that is not coming back), and an actor call can wait on a connection for long. So the
driver never blocks on ``result()`` alone: it polls, and between polls it asks the scheduler
whether the workers it waits on are still the ones the calls went to.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from flowrl.errors import NodeTimeout, WorkerLost, error_chain

POLL_S = 0.05
"""How long the driver waits on one call before looking at the others."""
LIVENESS_S = 0.5
"""How often the driver asks the scheduler which workers are registered while it waits."""


def gather(
    calls: Sequence[tuple[str, Any]],
    timeout_s: float,
    what: str,
    addresses: Mapping[str, str],
    registered: Callable[[], Mapping[str, str]],
    setting: str = "",
) -> list[Any]:
    """The results of ``(slot, future)`` calls, in order (``setting``: the field that sets
    ``timeout_s``, named in the timeout's message).

    Raises ``WorkerLost`` as soon as a slot's worker is no longer the one in ``addresses``
    (``registered()`` gives slot -> address now), ``NodeTimeout`` (the slots still busy count
    as hung) past ``timeout_s``, and a call's own error when it fails.
    """
    deadline = time.monotonic() + timeout_s
    check_at = time.monotonic() + LIVENESS_S
    results: dict[int, Any] = {}
    while len(results) < len(calls):
        for index, (_, future) in enumerate(calls):
            if index in results:
                continue
            try:
                results[index] = future.result(timeout=POLL_S)
            except TimeoutError:
                pass
        if len(results) == len(calls):
            break
        busy = sorted({slot for index, (slot, _) in enumerate(calls) if index not in results})
        now = time.monotonic()
        if now >= check_at:
            check_at = now + LIVENESS_S
            raise_if_lost(busy, addresses, registered(), what)
        if now >= deadline:
            named = f" ({setting})" if setting else ""
            raise NodeTimeout(f"{what} on {', '.join(busy)} did not finish within {timeout_s:g} s{named}", tuple(busy))
    return [results[index] for index in range(len(calls))]


def lost_slots(slots: Iterable[str], addresses: Mapping[str, str], now: Mapping[str, str]) -> list[str]:
    """The slots whose worker registered ``now`` is not the one in ``addresses`` (gone or
    replaced)."""
    return sorted(slot for slot in set(slots) if now.get(slot) != addresses.get(slot))


def raise_if_lost(slots: Sequence[str], addresses: Mapping[str, str], now: Mapping[str, str], what: str) -> None:
    lost = lost_slots(slots, addresses, now)
    if lost:
        raise WorkerLost(f"{what}: the worker of {', '.join(lost)} left the cluster", tuple(lost))


COLLECTIVE_SOURCES = ("gloo", "NCCL", "c10d", "ProcessGroup")
"""Words that say an error came from a collective library (gloo's messages carry their
source path, NCCL's and c10d's their names)."""
PEER_FAILURE_WORDS = ("Timed out", "timeout", "closed by peer", "reset by peer", "aborted")
"""What such an error says when a peer died or stopped answering: gloo's recv timeout and
closed connections, NCCL's watchdog timeout and aborted communicator."""
DIST_NETWORK_ERRORS = ("DistNetworkError", "DistStoreError")
"""torch.distributed's error classes for a lost connection or store, by name (the driver
does not import torch)."""


def peer_failed(error: BaseException) -> bool:
    """Whether ``error``, raised by one rank of a group, is a collective that failed because
    another rank died or hung (not a fault of this rank's own work). An input's failure
    forwarded by a node (``UpstreamFailed``) is that input's own error, never a peer's."""
    for link in error_chain(error):
        kinds = {kind.__name__ for kind in type(link).__mro__}
        if "UpstreamFailed" in kinds:
            return False
        if kinds & set(DIST_NETWORK_ERRORS):
            return True
        text = str(link)
        if isinstance(link, RuntimeError) and (
            "pair closure" in text  # gloo: a pair closed on its timeout
            or (any(source in text for source in COLLECTIVE_SOURCES) and any(word in text for word in PEER_FAILURE_WORDS))
        ):
            return True
    return False
