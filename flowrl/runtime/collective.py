"""A process group over the workers of one device group: NCCL on GPUs, gloo on CPU.

The driver picks ranks (the group's slots in plan order), asks the rank-0 worker for a free
port, and has every member join at once; the group rendezvous through a ``TCPStore`` that
rank 0 serves. Each group is its own process group (no process-wide default group), so a
worker can belong to several groups, and a group is re-formed on a new port when its
membership changes. A collective whose peer died raises instead of hanging (the group's
timeout).

A GPU group's collectives go through NCCL, device to device; the few small CPU tensors of a
step (flags, loss numbers) are staged through the card. NVLink multicast (NVLS) stays off in
every process that forms an NCCL group: on shared machines a program that uses it can take
the host's GPUs out of service.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from flowrl.errors import ClusterError

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""Environment that keeps NVLink multicast off in NCCL, PyTorch's symmetric memory and NVSHMEM."""


def free_port(host: str) -> int:
    """A TCP port nobody listens on at ``host`` now (the store binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def weights_group(node: str) -> str:
    """The name of the group over which update node ``node`` broadcasts new weights."""
    return f"{node}/weights"


def backend_for(device: torch.device) -> str:
    """``nccl`` for a CUDA device, ``gloo`` otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


class _Staged:
    """A collective on a device copy of a CPU tensor; ``wait()`` copies the result back."""

    def __init__(self, work: Any, staged: torch.Tensor, target: torch.Tensor) -> None:
        self.work, self.staged, self.target = work, staged, target

    def wait(self) -> bool:
        self.work.wait()
        self.target.copy_(self.staged)
        return True


class DeviceGroup:
    """One process group over a device group's workers, on ``device`` (this worker's).

    ``sharding``: the group a model is sharded over (FSDP2). torch's sharding builds its
    device mesh from the process's default group, so such a group is the default group of its
    workers: a worker can belong to one at a time (and to any number of other groups)."""

    def __init__(self, address: str, port: int, rank: int, world: int, timeout_s: float,
                 device: torch.device | str = "cpu", sharding: bool = False) -> None:
        timeout = timedelta(seconds=timeout_s)
        self.rank = rank
        self.world = world
        self.device = torch.device(device)
        self.backend = backend_for(self.device)
        # The store lives as long as the group: rank 0 serves it, the others are its clients.
        self._store = dist.TCPStore(address, port, world, is_master=(rank == 0), timeout=timeout)
        self._group: Any
        if self.backend == "nccl":
            if not dist.is_nccl_available():
                raise ClusterError("a GPU group needs NCCL, and this torch build has none: install a CUDA build of torch")
            for key, value in MULTICAST_OFF.items():
                os.environ.setdefault(key, value)  # read when NCCL initialises, below
        self.sharding = sharding
        self._mesh: Any = None
        if sharding:
            if dist.is_initialized():
                raise ClusterError("this worker already belongs to a group that shards a model; "
                                   "a worker can shard one group's models at a time")
            if self.device.type == "cuda" and self.device.index is not None:
                torch.cuda.set_device(self.device)
            dist.init_process_group(self.backend, store=self._store, rank=rank, world_size=world, timeout=timeout)
            self._group = dist.distributed_c10d._get_default_group()
        elif self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._group = dist.ProcessGroupNCCL(self._store, rank, world, options)
        else:
            self._group = dist.ProcessGroupGloo(self._store, rank, world, timeout)

    def mesh(self) -> Any:
        """The one-dimensional device mesh of a ``sharding`` group, for ``fully_shard``."""
        if not self.sharding:
            raise ValueError("only a group made with sharding=True has a device mesh")
        from torch.distributed.device_mesh import DeviceMesh

        if self._mesh is None:  # one mesh per group: the sharded model keeps referring to it
            self._mesh = DeviceMesh.from_group(self._group, self.device.type)
        return self._mesh

    def close(self) -> None:
        """Leave the group; a ``sharding`` group stops being this process's default group."""
        if self.sharding and dist.is_initialized():
            dist.destroy_process_group()

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the group, in place."""
        self.all_reduce_start(tensor).wait()

    def broadcast(self, tensor: torch.Tensor, source: int = 0) -> None:
        """Give every rank rank ``source``'s ``tensor``, in place."""
        options = dist.BroadcastOptions()
        options.rootRank = source
        if self.backend == "nccl" and tensor.device.type != "cuda":
            staged = tensor.to(self.device)
            _Staged(self._group.broadcast([staged], options), staged, tensor).wait()
        else:
            self._group.broadcast([tensor], options).wait()

    def all_reduce_start(self, tensor: torch.Tensor) -> Any:
        """Start summing ``tensor`` over the group in place; ``wait()`` on the result. Gloo
        runs it on its own threads and NCCL on its own stream, so the caller's computation
        goes on meanwhile."""
        if self.backend == "nccl" and tensor.device.type != "cuda":
            # NCCL reduces device memory only.
            staged = tensor.to(self.device)
            return _Staged(self._group.allreduce([staged]), staged, tensor)
        # The process groups' collectives are bound in C++ and missing from torch's stubs.
        return self._group.allreduce([tensor])
