"""A process group over the workers of one device group: gloo on CPU.

The driver picks ranks (the group's slots in plan order), asks the rank-0 worker for a free
port, and has every member join at once; the group rendezvous through a ``TCPStore`` that
rank 0 serves. Each group is its own ``ProcessGroupGloo`` (no process-wide default group),
so a worker can belong to several groups, and a group is re-formed on a new port when its
membership changes. A collective whose peer died raises instead of hanging.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def free_port(host: str) -> int:
    """A TCP port nobody listens on at ``host`` now (the store binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


class GlooGroup:
    def __init__(self, address: str, port: int, rank: int, world: int, timeout_s: float) -> None:
        timeout = timedelta(seconds=timeout_s)
        self.rank = rank
        self.world = world
        # The store lives as long as the group: rank 0 serves it, the others are its clients.
        self._store = dist.TCPStore(address, port, world, is_master=(rank == 0), timeout=timeout)
        self._group = dist.ProcessGroupGloo(self._store, rank, world, timeout)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the group, in place."""
        self.all_reduce_start(tensor).wait()

    def all_reduce_start(self, tensor: torch.Tensor) -> Any:
        """Start summing ``tensor`` over the group in place; ``wait()`` on the result. Gloo
        runs it on its own threads, so the caller's computation goes on meanwhile."""
        # ProcessGroupGloo's collectives are bound in C++ and missing from torch's stubs.
        return self._group.allreduce([tensor])  # type: ignore[attr-defined]
