"""Start or join the Dask cluster a run executes on.

Embedded mode starts a local ``SpecCluster`` of worker processes, one per device slot
(and warm spares, see ``keep_standby``). Cluster mode joins an existing scheduler; every
worker there is one slot: a GPU slot when it was started the Dask way for a GPU (see
:func:`claimed_gpu`), else a CPU slot. Role workers get ``memory_limit=0``: model weights count as unmanaged memory, and the
nanny would otherwise kill a worker that merely holds a model.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import sys
import threading
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import dask
from distributed import Client, Nanny, Scheduler, SpecCluster

from flowrl.devices.inventory import (
    Device,
    Host,
    Inventory,
    detect_local,
    inventory_from_dict,
    merge_inventories,
    names_gpu,
    visible_items,
)
from flowrl.errors import ClusterError
from flowrl.planner.cost import Overheads
from flowrl.planner.overhead_probe import cpu_overheads_or_defaults
from flowrl.spec.loader import pipeline_file
from flowrl.spec.schema import RuntimeSpec
from flowrl.runtime.warm_server import WARM_PRELOAD, set_warm_preload, start_warm_server

# torch (the serializers, the process groups) is imported where a cluster starts or joins,
# not here: a command starts the local cluster first (``PendingCluster``), so that the
# worker processes import torch while the command does.


@dataclass(frozen=True)
class WorkerSlot:
    """One Dask worker serving one device slot."""

    name: str
    """The device slot's name (``cpu-0``); in cluster mode, the worker's own name."""
    worker: Any
    """What Dask accepts in ``workers=[...]``: the worker's name."""
    address: str
    host: str
    kind: str = "cpu"
    cores: tuple[int, ...] | None = None
    """CPU cores the slot's worker is pinned to; None: not pinned (any core of its host)."""
    gpu_index: int | None = None
    """GPU slots: the card's NVML index (its worker sees only it, as cuda:0)."""


@dataclass(frozen=True)
class _Newcomer:
    """A worker that joined a joined cluster after the run started."""

    kind: str
    """The kind of slot it can take (``Cluster._kind``)."""
    inventory: Inventory
    gpu_index: int | None
    """Its card's NVML index on its machine; None for a CPU worker."""
    host: str = ""
    """Its host, as the scheduler knows it (as a slot's ``host``)."""
    refused: str = ""
    """Why it can take no slot (started wrongly for a GPU); empty: it can."""


PROBE_S = 5.0
"""The longest a joined newcomer's answer about its devices is waited for."""
PROBE_AGAIN_S = 2.0
"""A newcomer that did not answer is asked again after this long (lost slots look for one
every 0.1 s)."""


class Cluster:
    def __init__(self, client: Client, slots: list[WorkerSlot], local: SpecCluster | None,
                 reports: dict[str, Inventory] | None = None) -> None:
        self.client = client
        self.slots = slots
        self._local = local
        self._added = 0
        self._reports = reports or {}
        """Cluster mode: what each worker (by slot name) found on its machine."""
        self._newcomers: dict[tuple[str, str], _Newcomer] = {}
        """Cluster mode: workers that joined after the run started, by (name, address), as probed."""
        self._ask_again: dict[tuple[str, str], float] = {}
        """Cluster mode: newcomers that did not answer yet, and when to ask them again."""
        self._notes: list[str] = []
        """Newcomers refused, to be told once (:meth:`take_notes`)."""
        self._claimed = False
        self.reconnect_s = 0.0
        """A joined cluster: how long the client tries to reach a scheduler it lost (its
        connect timeout) before the run stops."""

    @classmethod
    def start_local(cls, num_slots: int, dashboard: bool = False, pin_cpus: bool = False) -> "Cluster":
        """One worker per CPU slot and, on a machine with GPUs, one more per GPU.

        Every worker is a ``Nanny`` (it restarts a killed worker process under the same name)
        and preloads ``flowrl.runtime.warm``, so it registers with torch and transformers
        imported. Without GPUs the worker processes are forked from a server that imported
        them once (see ``flowrl.runtime.warm_server``). A GPU worker sees its one card only: ``CUDA_VISIBLE_DEVICES`` is set in the
        nanny's environment before the worker process starts, so CUDA there knows that card
        alone, as ``cuda:0``.
        """
        gpus = [device.index for device in detect_local(num_cpu_slots=0).devices if device.kind == "gpu"]
        if start_warm_server(has_gpus=bool(gpus)):  # first: its imports run while this process imports torch
            from distributed.utils import get_mp_context

            dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"})
            get_mp_context()  # Dask's one-time choice of what a fork server imports...
            set_warm_preload()  # ...replaced by ours, for a server started again
        from flowrl.runtime.serialization import TorchSerializerPlugin, register

        register()
        _quiet_worker_config()
        specs = {f"cpu-{number}": _worker_spec(f"cpu-{number}", "") for number in range(num_slots)}
        specs.update({f"gpu-{index}": _worker_spec(f"gpu-{index}", str(index)) for index in gpus})
        scheduler = {
            "cls": Scheduler,
            "options": {"host": "127.0.0.1", "dashboard_address": "127.0.0.1:8787" if dashboard else ":0", "dashboard": dashboard},
        }
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Port 8787 is already in use")
                local = SpecCluster(workers=specs, scheduler=scheduler, silence_logs=logging.CRITICAL)
            client = Client(local, direct_to_workers=True)
        except Exception as error:  # any start-up failure is an environment problem
            raise ClusterError(
                f"cannot start a local Dask cluster of {len(specs)} workers: {str(error).rstrip('.')}."
                f"{_shadowing_hint(Path.cwd())}{_script_hint()}"
            ) from None  # the message holds the cause; Dask's start-up frames would bury it
        client.register_plugin(TorchSerializerPlugin())
        slots = []
        for slot in _slots(client, prefix=None):
            if slot.name.startswith("gpu-"):
                slot = replace(slot, kind="gpu", gpu_index=int(slot.name.removeprefix("gpu-")))
            slots.append(slot)
        if pin_cpus:  # CPU slots only: a GPU worker's threads only feed its card
            cpu_slots = [slot for slot in slots if slot.kind == "cpu"]
            shares = dict(zip([s.name for s in cpu_slots], split_cores(sorted(os.sched_getaffinity(0)), len(cpu_slots))))
            slots = [replace(slot, cores=shares[slot.name]) if slot.name in shares else slot for slot in slots]
        return cls(client, slots, local)

    @classmethod
    def join(cls, address: str, timeout_s: float = 30.0, tls: dict[str, str | None] | None = None) -> "Cluster":
        """Join a running scheduler. ``tls`` (``ca_file``, ``cert``, ``key``) builds Dask's
        ``Security`` with encryption required; without it Dask's own configuration applies
        (``distributed.comm.tls.*``)."""
        from flowrl.runtime.serialization import TorchSerializerPlugin, register

        register()
        security = None
        if tls and any(tls.values()):
            from distributed.security import Security

            missing = [f"runtime.tls_{key}: {path}" for key, path in tls.items() if path and not os.path.isfile(path)]
            if missing:
                raise ClusterError(f"TLS file not found ({'; '.join(missing)}); give the path of an existing PEM file")
            security = Security(tls_ca_file=tls.get("ca_file"), tls_client_cert=tls.get("cert"),
                                tls_client_key=tls.get("key"), require_encryption=True)
        _quiet_reconnect_errors()
        client = _connect(address, timeout_s, security)
        try:
            client.wait_for_workers(1, timeout=timeout_s)
        except TimeoutError as error:
            client.close()
            raise ClusterError(
                f"the Dask scheduler at {address} has no workers after {timeout_s:.0f} s: "
                "start some with `dask worker " + address + "`."
            ) from error
        try:
            client.register_plugin(TorchSerializerPlugin())
            slots = _slots(client, prefix=None)
            raw = client.run(_report_devices)
            reports = {slot.name: inventory_from_dict(raw[slot.address]) for slot in slots}
            started_with = {slot.name: raw[slot.address].get("started_with", {}) for slot in slots}
            slots = _gpu_slots(slots, reports, started_with)
            for name, note in gpu_declared_unseen(slots, reports, started_with).items():
                reports[name] = replace(reports[name], notes=(*reports[name].notes, note))
        except BaseException:
            client.close()
            raise
        cluster = cls(client, slots, None, reports)
        cluster.reconnect_s = timeout_s
        return cluster

    def connected(self) -> bool:
        """Whether the client's connection to the scheduler is up (not lost, not closed)."""
        return str(self.client.status) == "running"

    def inventory(self) -> Inventory:
        """The devices behind the workers, each CPU slot named after the slot it is.

        Embedded mode reads this machine (NVML + CPU). Cluster mode asks every worker to
        report its own host and devices, so the inventory spans machines.
        """
        if self._local is not None:
            return detect_local(num_cpu_slots=sum(1 for slot in self.slots if slot.kind == "cpu"))
        parts = []
        notes = []
        # A GPU worker serves its one card: the slot is that GPU, named after the worker.
        cards = {slot.name: device for slot in self.slots if slot.kind == "gpu"
                 for device in self._reports[slot.name].devices
                 if device.kind == "gpu" and device.index == slot.gpu_index}
        # A worker names NVLink peers by NVML index on its machine ("gpu-3"); in the cluster
        # they are the workers serving those cards.
        serving = {(card.host, f"gpu-{card.index}"): name for name, card in cards.items()}
        for number, slot in enumerate(self.slots):
            inventory = self._reports[slot.name]
            if slot.name in cards:
                card = cards[slot.name]
                peers = tuple(serving[card.host, peer] for peer in card.nvlink_peers if (card.host, peer) in serving)
                devices: tuple[Device, ...] = (replace(card, worker=slot.name, nvlink_peers=peers),)
            else:
                devices = tuple(replace(device, id=slot.name, worker=slot.name, index=number)
                                for device in inventory.devices if device.kind == "cpu")
                unclaimed = sum(1 for device in inventory.devices if device.kind == "gpu")
                if unclaimed:
                    notes.append(f"worker {slot.name} sees {unclaimed} GPU(s) but was not started for one: it is "
                                 "a CPU slot (start one worker per GPU with CUDA_VISIBLE_DEVICES=<index>, "
                                 "or `dask worker --resources GPU=1` on a one-GPU machine)")
            parts.append(replace(inventory, devices=devices))
        merged = merge_inventories(parts)
        # merge renumbers ids (and peers it cannot find stay as they are: the worker names set
        # above); slots keep their worker's name, which is what placement uses
        devices = tuple(replace(d, id=d.worker) if d.worker else d for d in merged.devices)
        return replace(merged, devices=devices, source=f"{len(self.slots)} Dask workers",
                       notes=(*merged.notes, *notes))

    def claim(self, run: str) -> None:
        """Mark a joined cluster as the cluster of run ``run`` (its output folder), in the
        scheduler's metadata; refuse when another run that is still connected marked it. A
        run plans as if the cluster were its own, so two would place their nodes on the same
        workers without knowing of each other. A run that ended, cleanly or not, has left the
        scheduler: its mark no longer counts."""
        from distributed import Lock

        lock = Lock(CLAIM_LOCK, scheduler_rpc=self.client.scheduler, loop=self.client.loop)
        # Checked and marked under a scheduler lock, so that two runs starting together do
        # not both find the cluster free; a lock that cannot be had is checked without it.
        try:
            locked = bool(lock.acquire(timeout=CLAIM_TIMEOUT_S))
        except Exception:  # noqa: BLE001 - a scheduler without the lock extension
            locked = False
        try:
            current = self.client.get_metadata(list(CLAIM_KEY), default=None)
            if isinstance(current, dict) and current.get("client") != self.client.id \
                    and self._still_connected(str(current.get("client"))):
                since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(current.get("since", 0))))
                raise ClusterError(
                    f"another flowrl run is using the Dask cluster at {self.client.scheduler.address}: "
                    f"{current.get('run')} (on {current.get('host')}, process {current.get('pid')}, since {since}). A run "
                    "plans as if the cluster were its own, so two runs on one cluster would place their nodes on "
                    "the same workers; give this run a scheduler and workers of its own, or start it when the "
                    "other has finished")
            self.client.set_metadata(list(CLAIM_KEY), {"client": self.client.id, "run": run, "host": socket.gethostname(),
                                                       "pid": os.getpid(), "since": time.time()})
            self._claimed = True
        finally:
            if locked:
                lock.release()

    def _still_connected(self, client: str) -> bool:
        """Whether ``client`` is connected to the scheduler, given a few seconds to leave: a
        run that has just ended may not have left yet."""
        deadline = time.monotonic() + CLAIM_LEAVE_S
        while client in self._connected_clients():
            if time.monotonic() > deadline:
                return True
            time.sleep(0.2)
        return False

    def _connected_clients(self) -> set[str]:
        """The ids of the clients connected to the scheduler; none when the scheduler runs
        no functions (``distributed.scheduler.pickle: false``): a mark that cannot be told
        live from stale refuses no run (a run clears its own when it closes)."""
        try:
            # a lambda travels by value: the scheduler need not have flowrl installed
            return set(self.client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.clients)))
        except Exception:  # noqa: BLE001 - a scheduler that refuses the call
            return set()

    def _unclaim(self) -> None:
        """Take this run's mark off the scheduler, if it is still this run's."""
        try:
            current = self.client.get_metadata(list(CLAIM_KEY), default=None)
            if isinstance(current, dict) and current.get("client") == self.client.id:
                self.client.set_metadata(list(CLAIM_KEY), None)
        except Exception:  # noqa: BLE001 - a scheduler already gone keeps no mark to clear
            pass

    @property
    def dashboard_link(self) -> str | None:
        return self.client.dashboard_link if self._local is not None and self._local.dashboard_link else None

    def addresses(self, listing: dict[str, Any] | None = None) -> dict[str, str]:
        """Slot -> the address of its worker registered right now (absent: none is). A worker
        that was replaced has a new address under the same name. ``listing``: the scheduler's
        worker listing (``registered_workers``) when the caller has just read it."""
        by_name = workers_by_name(registered_workers(self.client) if listing is None else listing)
        return {slot.name: by_name[str(slot.worker)][0] for slot in self.slots if str(slot.worker) in by_name}

    def machine_of(self, slot_name: str) -> Host | None:
        """The machine serving ``slot_name`` as its worker reported it on a joined cluster (the
        machines of a joined cluster may differ from each other and from this one); None on a
        local cluster (its workers run here) or without a report."""
        report = self._reports.get(slot_name)
        if self._local is None and report is not None and report.hosts:
            return report.hosts[0]
        return None

    def cores_of(self, slot_name: str) -> int:
        """Logical cores of the machine serving ``slot_name`` (:meth:`machine_of`), else this
        machine's."""
        machine = self.machine_of(slot_name)
        return max(1, machine.cores if machine is not None else (os.cpu_count() or 1))

    def worker_of(self, slot_name: str) -> str:
        """The name of the Dask worker serving slot ``slot_name`` now."""
        return next(str(slot.worker) for slot in self.slots if slot.name == slot_name)

    def cpu_overheads(self, timeout_s: float = 120.0) -> tuple[str, Overheads] | None:
        """(slot, its overheads) measured on the first CPU slot's worker
        (``planner.overhead_probe``: the worker imports torch and transformers for its models
        anyway, the driver does not); None without a CPU slot, or when the probe does not
        answer within ``timeout_s`` (a failing probe answers the defaults, with a warning)."""
        slot = next((slot.name for slot in self.slots if slot.kind == "cpu"), None)
        if slot is None:
            return None
        try:
            future = self.client.submit(cpu_overheads_or_defaults, pure=False, workers=[self.worker_of(slot)],
                                        allow_other_workers=False)
            return slot, future.result(timeout=timeout_s)
        except Exception:  # noqa: BLE001 - a lost worker or a timeout leaves the defaults
            return None

    def alive(self) -> set[str]:
        """The slots whose worker is registered with the scheduler right now."""
        return set(self.addresses())

    def keep_standby(self, per_kind: int) -> None:
        """Start ``per_kind`` warm spare workers for each kind of slot (CPU, each GPU) of a
        local cluster, without waiting for them: a spare takes a lost or hung slot's place
        at once (see :meth:`take_over`). A killed worker's nanny starts it again under its
        own name; once a spare holds its slot, it comes back as a spare itself."""
        if self._local is None or per_kind <= 0:
            return
        for kind in sorted({_slot_kind(slot) for slot in self.slots}):
            visible = kind.removeprefix("gpu-") if kind.startswith("gpu-") else ""
            for number in range(per_kind):
                name = f"{SPARE_PREFIX}{kind}-{number}"
                self._local.worker_spec.setdefault(name, _worker_spec(name, visible))
        self._local.scale(len(self._local.worker_spec))

    def add_workers(self, names: set[str]) -> list[str]:
        """Start a new worker (a new nanny, as a spare) for each slot of ``names`` of a local
        cluster: for slots whose worker's nanny does not bring it back. Returns their names."""
        if self._local is None:
            return []
        started = []
        for slot in self.slots:
            if slot.name in names:
                kind = _slot_kind(slot)
                self._added += 1
                name = f"{SPARE_PREFIX}{kind}-new-{self._added}"
                self._local.worker_spec[name] = _worker_spec(name, kind.removeprefix("gpu-") if kind != "cpu" else "")
                started.append(name)
        if started:
            self._local.scale(len(self._local.worker_spec))
        return started

    def spares(self, listing: dict[str, Any] | None = None) -> dict[str, str]:
        """Registered workers that serve no slot: name -> the kind of slot each can take
        (:meth:`_kind`). A local cluster's are its standby workers; a joined cluster's are the
        workers that joined after the run started, such as a lost worker's replacement that a
        batch system or an operator started under a new name. ``listing`` as for
        :meth:`addresses`."""
        serving = {str(slot.worker) for slot in self.slots}
        workers = workers_by_name(registered_workers(self.client) if listing is None else listing)
        if self._local is not None:
            return {name: _worker_kind(name) for name in sorted(set(workers) - serving)}
        spares = {}
        for name, (address, host) in sorted(workers.items()):
            key = (name, address)
            if name in serving or time.monotonic() < self._ask_again.get(key, 0.0):
                continue
            if key not in self._newcomers:
                newcomer = self._probe(name, address, host)
                if newcomer is None:  # not answering yet (still starting, or stopped)
                    self._ask_again[key] = time.monotonic() + PROBE_AGAIN_S
                    continue
                self._newcomers[key] = newcomer
                if newcomer.refused:
                    self._notes.append(newcomer.refused)
            if not self._newcomers[key].refused:
                spares[name] = self._newcomers[key].kind
        return spares

    def _probe(self, name: str, address: str, host: str) -> _Newcomer | None:
        """A joined newcomer's machine and card, asked of it as every worker was at the start;
        None when it does not answer within ``PROBE_S`` (a wedged or stopped worker never
        does); a refused one when it cannot serve a slot as started."""
        outcome = call_within(lambda: self.client.run(_report_devices, workers=[address]), PROBE_S, "flowrl-probe")
        if not outcome.finished or outcome.error is not None:
            return None
        raw = outcome.result[address]
        inventory = inventory_from_dict(raw)
        started = raw.get("started_with", {})
        try:
            gpu = claimed_gpu(inventory, started.get("cuda_visible_devices"), float(started.get("gpu_resource", 0)))
        except ClusterError as error:
            return _Newcomer(kind="", inventory=inventory, gpu_index=None, host=host,
                             refused=f"worker {name} joined the cluster but cannot take a lost slot: {error}")
        return _Newcomer(kind="cpu" if gpu is None else f"gpu:{gpu.name}", inventory=inventory,
                         gpu_index=None if gpu is None else gpu.index, host=host)

    def take_notes(self) -> list[str]:
        """What to tell the user about newcomers refused since the last call."""
        notes, self._notes = self._notes, []
        return notes

    @property
    def joined(self) -> bool:
        """Whether the run joined a running scheduler (else it started a local cluster)."""
        return self._local is None

    def _kind(self, slot: WorkerSlot) -> str:
        """What a spare must be to take ``slot``'s place. A local cluster: ``cpu`` or
        ``gpu-<index>`` (a GPU worker sees one card, fixed when its process starts). A joined
        one: ``cpu``, or ``gpu:<model>``, a worker serving a card of the same model on any
        machine (the plan's memory and speed hold for it)."""
        if self._local is not None or slot.kind != "gpu":
            return _slot_kind(slot)
        card = next((device for device in self._reports[slot.name].devices
                     if device.kind == "gpu" and device.index == slot.gpu_index), None)
        return f"gpu:{card.name if card is not None else '?'}"

    def take_over(self, names: set[str], hung: set[str]) -> list[str]:
        """Give each slot of ``names`` whose worker is gone, and each ``hung`` one, a
        registered spare of its kind; returns the slots that got one. A hung worker that
        lost its slot is restarted in the background (it comes back as a spare)."""
        listing = registered_workers(self.client)  # one listing serves the whole pass
        registered = self.addresses(listing)
        free = self.spares(listing)
        by_name = workers_by_name(listing)
        taken = []
        for index, slot in enumerate(self.slots):
            if slot.name not in names or (slot.name in registered and slot.name not in hung):
                continue
            # a card that a slot still served by its worker has: never two workers on one card
            served = {(other.host, other.gpu_index) for other in self.slots
                      if other.kind == "gpu" and other.name in registered and other.name != slot.name}
            spare = next((name for name, kind in free.items() if kind == self._kind(slot)
                          and not self._on_served_card(name, served)), None)
            if spare is None:
                continue
            del free[spare]
            if slot.name in hung:
                threading.Thread(target=self.restart_workers, args=([slot.worker], 60.0), daemon=True).start()
            address = by_name[spare][0] if spare in by_name else None
            taker = replace(slot, worker=spare, address=address or slot.address)
            newcomer = self._newcomers.get((spare, address or ""))
            if newcomer is not None:  # a joined worker: its own machine and card from now on
                taker = self._on_machine_of(taker, newcomer)
            self.slots[index] = taker
            taken.append(slot.name)
        return taken

    def returned(self, names: set[str]) -> list[str]:
        """Of the slots ``names`` on a joined cluster, those whose worker came back under its
        own name at a new address (a batch system that restarts it with the same ``--name``,
        perhaps on another machine): each is asked about its devices once, as newcomers are,
        and the slot takes the machine and card it reports. Returns the slots updated; one
        that does not answer within ``PROBE_S``, or is not the kind of worker the slot needs
        (another card model, no card), keeps what it had (the latter with a note)."""
        if self._local is not None:
            return []
        current = workers_by_name(registered_workers(self.client))
        updated = []
        for index, slot in enumerate(self.slots):
            found = current.get(str(slot.worker))
            if slot.name not in names or found is None or found[0] == slot.address:
                continue
            address, host = found
            back = self._probe(str(slot.worker), address, host)
            if back is None:
                continue
            if back.refused or back.kind != self._kind(slot):
                self._notes.append(back.refused or f"worker {slot.worker} came back as a {back.kind} worker where "
                                   f"slot {slot.name} is {self._kind(slot)}: the run keeps planning it as before")
                continue
            self.slots[index] = self._on_machine_of(replace(slot, address=address), back)
            updated.append(slot.name)
        return updated

    def _on_machine_of(self, slot: WorkerSlot, worker: _Newcomer) -> WorkerSlot:
        """``slot`` served by ``worker`` (probed: a newcomer, or its own worker back at a new
        address): the worker's machine, card and report from now on."""
        self._reports[slot.name] = worker.inventory
        return replace(slot, host=worker.host or slot.host, gpu_index=worker.gpu_index, cores=None)

    def _on_served_card(self, name: str, served: set[tuple[str, int | None]]) -> bool:
        newcomer = next((item for (known, _), item in self._newcomers.items() if known == name), None)
        return newcomer is not None and newcomer.gpu_index is not None and (newcomer.host, newcomer.gpu_index) in served

    def restart_workers(self, workers: list[Any], timeout_s: float) -> None:
        try:
            self.client.restart_workers(workers, timeout=timeout_s, raise_for_error=False)
        except Exception:  # noqa: BLE001 - a worker that cannot restart is waited for or replaced
            pass

    def restart(self, names: list[str], timeout_s: float) -> None:
        """Restart the workers of ``names`` (hung ones): their nannies start fresh processes."""
        self.restart_workers([slot.worker for slot in self.slots if slot.name in names], timeout_s)

    def close(self) -> None:
        # Quiet shutdown: a closing cluster logs connection noise that means nothing here.
        logging.getLogger("distributed").setLevel(logging.CRITICAL)
        if self._claimed and self.connected():
            self._unclaim()
        self.client.close()
        if self._local is not None:
            self._local.close()


CLAIM_KEY = ("flowrl", "run")
"""Where in the scheduler's metadata a joined run marks the cluster as its own."""
CLAIM_LOCK = "flowrl-claim"
CLAIM_TIMEOUT_S = 10.0
CLAIM_LEAVE_S = 3.0


class _DropReconnectErrors(logging.Filter):
    """Drops the client's "Failed to reconnect to scheduler" log line: the run says the same
    in its own words (the scheduler cannot be reached, what was kept, how to resume)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Failed to reconnect")


def _quiet_reconnect_errors() -> None:
    logger = logging.getLogger("distributed.client")
    if not any(isinstance(f, _DropReconnectErrors) for f in logger.filters):
        logger.addFilter(_DropReconnectErrors())


@contextlib.contextmanager
def main_without_a_missing_file() -> Iterator[None]:
    """Inside this block, a main module whose ``__file__`` names no file (a script read from
    stdin: ``python - < script.py`` sets ``<stdin>``) has no ``__file__``: worker processes
    started by spawn would otherwise run that "file" again and fail to start. Without it they
    start as for ``python -c`` or a notebook."""
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None)
    if main is None or not isinstance(script, str) or Path(script).is_file():
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = script


def _script_hint() -> str:
    """For a user's script (not flowrl's own command): the usual cause of workers that fail
    to start."""
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    if script is None or Path(script).name == "flowrl" or Path(script).parent == Path(__file__).parents[1] / "cli":
        return ""
    return (" Worker processes import the main script again: when a script calls flowrl.run, put that call "
            "under `if __name__ == \"__main__\":`.")


def _shadowing_hint(folder: Path) -> str:
    """Worker processes start with the working directory first on their import path: a file
    there named as a module they import (``random.py``, ``tokenizers.py``) replaces it, and
    the workers fail to start. Named here, where only the workers' noise would say it."""
    # modules the driver took from elsewhere (a reward's helper module imported from this
    # folder is the user's own, not a shadow)
    imported = {name for name, module in list(sys.modules.items())  # a copy: threads may import meanwhile
                if "." not in name and name != "__main__" and not _inside(module, folder)}
    try:
        shadowing = sorted(item.name for item in folder.iterdir()
                           if (item.suffix == ".py" and item.stem in imported)
                           or (item.is_dir() and item.name in imported and (item / "__init__.py").is_file()))
    except OSError:
        return ""
    if not shadowing:
        return ""
    one = len(shadowing) == 1
    return (f" The working directory {folder} holds {', '.join(shadowing)}, named as "
            f"{'a module' if one else 'modules'} Python or flowrl imports: the workers, which start there, import "
            f"{'it' if one else 'them'} instead; rename {'it' if one else 'them'}, or run from another folder.")


def _inside(module: object, folder: Path) -> bool:
    """Whether ``module`` was imported from a file in ``folder``."""
    origin = getattr(module, "__file__", None)
    try:
        return origin is not None and folder.resolve() in Path(origin).resolve().parents
    except OSError:
        return False


CONNECT_GRACE_S = 10.0
"""Time past the join's own timeout that a connection may take before it is given up: Dask's
client enforces its timeout on reaching the address, not on a service there that accepts the
connection and never answers."""


@dataclass
class Within:
    """What a call run by :func:`call_within` came to: ``finished`` in time, and then its
    ``result`` or the ``error`` it raised."""

    finished: bool = False
    result: Any = None
    error: BaseException | None = None


def call_within(function: Callable[[], Any], seconds: float, name: str) -> Within:
    """``function()`` on a daemon thread, waited on for ``seconds`` at most: a call that never
    returns (a service that never answers, a worker that is stopped) is left behind, not
    waited on, and never keeps the process from exiting."""
    outcome = Within()

    def call() -> None:
        try:
            outcome.result = function()
        except BaseException as error:  # noqa: BLE001 - handed to the caller, whatever it is
            outcome.error = error
        outcome.finished = True

    thread = threading.Thread(target=call, name=name, daemon=True)
    thread.start()
    thread.join(seconds)
    return outcome


REACH_S = 3.0
"""The longest one plain connection to a scheduler's port may take, its host name's lookup
included; one that takes longer (a slow resolver or network) is left to Dask's own
connection, which retries for its whole timeout."""
STARTING_S = 10.0
"""How long a port that refuses is tried again before the join fails: a scheduler started
just before the run (``dask scheduler & flowrl run ...``) opens it within seconds."""
_UNKNOWN_HOST = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}
"""Lookup failures that say the name does not exist (not a resolver that failed for now)."""


def _unreachable(address: str, wait_s: float = STARTING_S) -> str | None:
    """Why nothing can answer at ``address``, found without Dask's timeout: its host name is
    not known, or its port still refuses connections (nothing listens there) after
    ``wait_s``. None when a connection opens, when the lookup or the network is only slow or
    failed for now (Dask's retries decide), or for other kinds of address."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(address)
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    if parts.scheme not in ("tcp", "tls") or host is None or port is None:
        return None
    deadline = time.monotonic() + wait_s
    while True:
        outcome = call_within(lambda: _try_connect(host, port), REACH_S + 1.0, "flowrl-reach")
        if not outcome.finished or outcome.error is not None:
            return None
        problem: str | None = outcome.result
        if problem is None or not problem.startswith("nothing listens") or time.monotonic() >= deadline:
            return problem
        time.sleep(0.5)


def _try_connect(host: str, port: int) -> str | None:
    """One plain connection to ``host``:``port``: None when it opens or fails in a way Dask
    may get past, else why it cannot."""
    try:
        with socket.create_connection((host, port), timeout=REACH_S):
            return None
    except socket.gaierror as error:
        return f"the host name '{host}' is not known" if error.errno in _UNKNOWN_HOST else None
    except ConnectionRefusedError:
        return f"nothing listens on port {port} of {host} (connection refused)"
    except OSError:
        return None


def _connect(address: str, timeout_s: float, security: Any) -> Client:
    """A client of the scheduler at ``address``, or a ClusterError: when nothing answers there
    (said at once for an unknown host, within ``STARTING_S`` for a port that refuses), when
    what answers is not a Dask scheduler, or when no answer comes in time."""
    check = "Check the address (tcp://HOST:PORT) and that `dask scheduler` is running there."
    unreachable = _unreachable(address, min(STARTING_S, timeout_s))
    if unreachable is not None:
        raise ClusterError(f"cannot reach the Dask scheduler at {address}: {unreachable}. {check}")
    outcome = call_within(lambda: Client(address, direct_to_workers=True, timeout=timeout_s, security=security),
                          timeout_s + CONNECT_GRACE_S, "flowrl-join")
    if not outcome.finished:
        raise ClusterError(f"the service at {address} accepted the connection but gave no Dask scheduler's answer "
                           f"in {timeout_s + CONNECT_GRACE_S:.0f} s. {check}")
    error = outcome.error
    if isinstance(error, (OSError, TimeoutError)):
        raise ClusterError(f"cannot reach the Dask scheduler at {address}: {error}. {check}") from None
    if isinstance(error, KeyboardInterrupt):
        raise error
    if error is not None:
        raise ClusterError(f"what answers at {address} is not a Dask scheduler ({type(error).__name__}: "
                           f"{str(error)[:200]}). {check}") from None
    client: Client = outcome.result
    return client


def join_for(runtime: RuntimeSpec, address: str, base_dir: Path, timeout_s: float = 30.0) -> Cluster:
    """Join the scheduler at ``address`` with the pipeline's TLS files (``runtime.tls_*``, read
    from the pipeline's folder ``base_dir`` first, as data files are)."""
    tls = {"ca_file": pipeline_file(runtime.tls_ca_file, base_dir), "cert": pipeline_file(runtime.tls_cert, base_dir),
           "key": pipeline_file(runtime.tls_key, base_dir)}
    return Cluster.join(address, timeout_s, tls)


def split_cores(cores: list[int], num_slots: int) -> list[tuple[int, ...]]:
    """Consecutive, equal shares of ``cores`` for ``num_slots`` slots (the first ones get
    one more when they do not divide); every slot gets at least one core."""
    if num_slots > len(cores):
        raise ClusterError(
            f"runtime.pin_cpus: {num_slots} CPU slots cannot each have their own core on "
            f"{len(cores)} cores. Lower runtime.cpu_slots or set pin_cpus: false."
        )
    size, extra = divmod(len(cores), num_slots)
    shares, start = [], 0
    for number in range(num_slots):
        end = start + size + (1 if number < extra else 0)
        shares.append(tuple(cores[start:end]))
        start = end
    return shares


SPARE_PREFIX = "spare-"


def _worker_spec(name: str, visible_devices: str) -> dict[str, Any]:
    """A local worker: a nanny-kept process with one thread, no memory limit (model weights
    are unmanaged memory the nanny would otherwise kill it for), warm imports, NVLink
    multicast off (see ``collective.MULTICAST_OFF``)."""
    from flowrl.runtime.collective import MULTICAST_OFF

    # A forked worker inherits the fork server's environment, fixed when the server started;
    # a spawned one this process's at the moment. The nanny sets ``env`` in the worker before
    # anything runs there, so both see the variables as they are now (FLOWRL_CACHE, HF_*).
    forked = dask.config.get("distributed.worker.multiprocessing-method") == "forkserver"
    current = dict(os.environ) if forked else {}
    options = {
        "name": name, "nthreads": 1, "memory_limit": 0, "host": "127.0.0.1", "silence_logs": logging.CRITICAL,
        "env": {**current, "CUDA_VISIBLE_DEVICES": visible_devices, **MULTICAST_OFF}, "preload": [WARM_PRELOAD],
    }
    return {"cls": Nanny, "options": options}


def _slot_kind(slot: WorkerSlot) -> str:
    """What a spare must be to take the slot's place: ``cpu``, or ``gpu-<index>`` (a GPU
    worker sees one card, fixed when its process starts)."""
    return f"gpu-{slot.gpu_index}" if slot.kind == "gpu" else "cpu"


def _worker_kind(name: str) -> str:
    """The slot kind a local worker serves, from its name (``cpu-1``, ``spare-gpu-0-1``)."""
    base = name.removeprefix(SPARE_PREFIX)
    if base.startswith("gpu-"):
        return "gpu-" + base.removeprefix("gpu-").split("-")[0]
    return "cpu"


def _quiet_worker_config() -> None:
    # Worker config travels with the nanny to each worker process. The statistical
    # profiler samples every thread's stack every 10 ms while holding the GIL, which
    # roughly doubled the time of a small model's node calls: flowrl times nodes itself.
    #
    # The nanny also sets MALLOC_TRIM_THRESHOLD_=65536 in each worker, which makes glibc
    # return memory to the OS so eagerly that torch's many small allocations cost 1.8x
    # the time (measured: an update step of builtin:tiny-llama 41 ms -> 72-76 ms).
    environ = dict(dask.config.get("distributed.nanny.pre-spawn-environ"))
    environ.pop("MALLOC_TRIM_THRESHOLD_", None)
    #
    # A local cluster closes the nanny of a worker that has not registered again within
    # ``distributed.deploy.lost-worker-timeout`` (15 s) of its loss. Several replacements
    # importing torch at once on a busy machine take longer than that, and a closed nanny
    # never brings its worker back: the run's own deadline (runtime.recovery_timeout_s) decides.
    #
    # Every process of the cluster wakes on timers that serve Dask's dashboard and its own
    # health checks: the event-loop tick every 20 ms, psutil's process and disk counters every
    # 500 ms, the memory monitor every 100 ms. On 2 cores each wake-up takes a core from a
    # node's torch threads, whose parallel regions then wait for it; slower timers halved the
    # CPU time the cluster spent besides the node calls (measured per thread over 8 s of
    # builtin:small-llama steps: 0.84-0.89 s before, 0.44-0.59 s after).
    dask.config.set({"distributed.worker.profile.enabled": False, "distributed.nanny.pre-spawn-environ": environ,
                     "distributed.deploy.lost-worker-timeout": "24h",
                     "distributed.admin.tick.interval": "500ms",
                     "distributed.admin.system-monitor.interval": "2s",
                     "distributed.admin.system-monitor.disk": False,
                     "distributed.worker.memory.monitor-interval": "1s"})


def _report_devices(dask_worker: Any) -> dict[str, Any]:
    """Run on a joined worker: its machine's devices (the GPUs it may use, by
    ``CUDA_VISIBLE_DEVICES``) and how it was started (``CUDA_VISIBLE_DEVICES``, a ``GPU``
    resource)."""
    report = detect_local(num_cpu_slots=1).to_dict()
    state = getattr(dask_worker, "state", dask_worker)
    resources = getattr(state, "total_resources", None) or {}
    report["started_with"] = {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                              "gpu_resource": float(resources.get("GPU", 0))}
    return report


def claimed_gpu(inventory: Inventory, cuda_visible_devices: str | None, gpu_resource: float) -> Device | None:
    """The GPU a joined worker serves, or None for a CPU slot.

    The Dask conventions for GPU workers: ``CUDA_VISIBLE_DEVICES`` names the worker's card
    first (``dask cuda worker`` starts one worker per GPU with the list rotated: ``2,3,0,1``),
    so the worker's ``cuda:0`` is that card; or ``dask worker --resources GPU=1`` on a machine
    with one GPU. A worker that declares a GPU but sees several and was not told which one
    is an error (each would take the same card).
    """
    gpus = [device for device in inventory.devices if device.kind == "gpu"]
    if cuda_visible_devices is not None:
        items = visible_items(cuda_visible_devices)
        return next((device for device in gpus if items and names_gpu(items[0], device.index, device.uuid)), None)
    if gpu_resource > 0 and len(gpus) == 1:
        return gpus[0]
    if gpu_resource > 0 and gpus:
        raise ClusterError(
            f"a worker started with a GPU resource sees {len(gpus)} GPUs and CUDA_VISIBLE_DEVICES is not set: "
            "start one worker per GPU with CUDA_VISIBLE_DEVICES=<index> (or use `dask cuda worker`)")
    return None


def _gpu_slots(slots: list[WorkerSlot], reports: dict[str, Inventory],
               started_with: dict[str, dict[str, Any]]) -> list[WorkerSlot]:
    """Joined workers started for a GPU become GPU slots (see :func:`claimed_gpu`);
    ``started_with``: each worker's ``CUDA_VISIBLE_DEVICES`` and ``GPU`` resource."""
    out = []
    owners: dict[str, str] = {}
    for slot in slots:
        started = started_with[slot.name]
        try:
            gpu = claimed_gpu(reports[slot.name], started.get("cuda_visible_devices"),
                              float(started.get("gpu_resource", 0)))
        except ClusterError as error:
            raise ClusterError(f"worker {slot.name}: {error}") from None
        if gpu is None:
            out.append(slot)
            continue
        card = f"{slot.host}/{gpu.uuid or gpu.index}"
        if card in owners:
            raise ClusterError(f"workers {owners[card]} and {slot.name} both serve GPU {gpu.index} of {slot.host}: "
                               "give each worker its own card with CUDA_VISIBLE_DEVICES")
        owners[card] = slot.name
        out.append(replace(slot, kind="gpu", gpu_index=gpu.index))
    return out


def gpu_declared_unseen(slots: list[WorkerSlot], reports: dict[str, Inventory],
                        started_with: dict[str, dict[str, Any]]) -> dict[str, str]:
    """A note for each worker started with a ``GPU`` resource that sees no GPU at all, so a
    CPU slot: by worker name, so that the run says so instead of counting it quietly. (One
    that sees GPUs it was not given is noted where the inventory is built.)"""
    return {slot.name: f"worker {slot.name} was started with a GPU resource but sees no GPU: it is a CPU slot "
                       "(check that its machine has a GPU, its driver and nvidia-ml-py, and its CUDA_VISIBLE_DEVICES)"
            for slot in slots
            if slot.kind == "cpu" and float(started_with.get(slot.name, {}).get("gpu_resource", 0) or 0) > 0
            and not any(device.kind == "gpu" for device in reports[slot.name].devices)}


def workers_by_name(listing: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """A scheduler's worker listing (``registered_workers``) by worker name: (address, host)."""
    return {str(info["name"]): (str(address), str(info.get("host", ""))) for address, info in listing.items()}


def registered_workers(client: Client) -> dict[str, Any]:
    """The scheduler's workers right now: address -> info. Asked of the scheduler directly:
    ``Client.scheduler_info`` returns a cached copy that the client's periodic refresh
    replaces with one without workers, and a call can read that copy just after its own
    refresh (seen as every worker gone at once, in the middle of a step)."""
    scheduler = client.scheduler
    if scheduler is None:  # the client closed itself after its scheduler went away
        raise OSError(f"the Dask client closed its connection to the scheduler (status: {client.status})")
    identity = client.sync(scheduler.identity, n_workers=-1)
    return dict(identity.get("workers", {}))


def _slots(client: Client, prefix: str | None) -> list[WorkerSlot]:
    workers = registered_workers(client)
    slots = []
    for address, info in workers.items():
        name = info["name"]
        slot_name = f"{prefix}{name}" if prefix is not None else str(name)
        slots.append(WorkerSlot(name=slot_name, worker=name, address=address, host=info.get("host", "")))
    return sorted(slots, key=lambda slot: _natural_key(slot.name))


def _natural_key(name: str) -> tuple[Any, ...]:
    head = name.rstrip("0123456789")
    tail = name[len(head):]
    return (head, int(tail) if tail else -1)


START_WAIT_S = 120.0
"""The longest an exiting interpreter waits for a discarded local cluster to finish starting."""


class PendingCluster:
    """A local cluster that starts on a thread of its own (``Cluster.start_local``), so the
    worker processes start and import torch while the caller goes on: imports, the data,
    the checks. ``take`` waits for it; a pending cluster nobody takes is closed by
    ``discard``."""

    def __init__(self, num_slots: int, dashboard: bool = False, pin_cpus: bool = False) -> None:
        self.arguments = (num_slots, dashboard, pin_cpus)
        self._cluster: Cluster | None = None
        self._error: BaseException | None = None
        self._outcome: str | None = None
        """None while nobody decided; ``taken`` by a run, or ``discarded``."""
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._start, name="flowrl-cluster-start", daemon=True)
        self._thread.start()

    def _start(self) -> None:
        try:
            cluster = Cluster.start_local(*self.arguments)
        except BaseException as error:  # raised to whoever takes the cluster
            self._error = error
            return
        with self._lock:
            self._cluster = cluster
            discarded = self._outcome == "discarded"
        if discarded:  # while it started
            cluster.close()

    def take(self, num_slots: int, dashboard: bool, pin_cpus: bool) -> Cluster | None:
        """The started cluster when it has these settings (its start-up error, if it failed);
        None, after closing it, when the run asks for another one."""
        if (num_slots, dashboard, pin_cpus) != self.arguments:
            self.discard()
            return None
        with self._lock:
            self._outcome = "taken"
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._cluster is not None
        return self._cluster

    def discard(self) -> None:
        """Close the cluster unless a run took it (that run closes it). A cluster still
        starting is closed by its own thread once started; an interpreter that exits first
        waits for that thread (Dask's own exit handler fails on a cluster half started)."""
        with self._lock:
            if self._outcome is not None:
                return
            self._outcome = "discarded"
            cluster = self._cluster
        if cluster is not None:
            cluster.close()
        elif self._thread.is_alive():
            # registered after Dask's handler, so run before it
            atexit.register(self._thread.join, START_WAIT_S)
