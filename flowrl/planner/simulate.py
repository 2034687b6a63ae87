"""Predict one iteration by simulating its schedule: a timeline and its critical path.

The runtime submits node calls in topological order and each device runs its calls one
at a time, in the order they were submitted (one Dask actor per role and device). So the
simulation is a list schedule in that order::

    start(node) = max( max over inputs p of end(p) + transfer(p -> node),   # data ready
                       max over the node's devices d of free(d) )           # device free
    end(node)   = start(node) + compute(node on its devices)

Transfers are asynchronous (they hold no device). After the last update, a policy whose
generator sits on other devices has its new weights sent there ("sync" tasks); the next
iteration cannot start generating before that, so they count in the iteration time.

The critical path walks back from the task that ends last, each time to whatever set
its start: the input that arrived last, or the earlier task that held its device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from flowrl.devices.inventory import Device, Inventory
from flowrl.graph import PipelineGraph
from flowrl.planner.cost import compile_benchmark_bytes, matmul_workspace_bytes, weight_bytes
from flowrl.planner.costs import GB, CostSource, transfer_s
from flowrl.planner.sharing import core_shares, host_cores, shared_time
from flowrl.spec.schema import SOURCE_NODE, GenerateNode, NodeBase, UpdateNode

GPU_CONTEXT_GB = 0.5
"""Memory a CUDA context and the allocator's slack take on each GPU a worker uses (outside
the allocator's count: ``torch.cuda.max_memory_allocated`` does not see it)."""


@dataclass(frozen=True)
class Placement:
    """Where one node runs."""

    devices: tuple[str, ...]
    """Device ids; more than one means data-parallel over them."""
    offloaded: bool = False
    """The model's weights stay in host memory and are paged onto the GPU for the call."""
    note: str = ""
    """Why this option exists (``its group``, ``colocated with rollout``, ``cpu offload``)."""


@dataclass(frozen=True)
class Task:
    """One bar of the timeline."""

    name: str
    """Node name, or ``sync:<model>`` for a weight transfer."""
    kind: str
    """``node`` or ``sync``."""
    devices: tuple[str, ...]
    start_s: float
    end_s: float
    after: str | None
    """The task whose end set this start (an input or the device's previous task)."""


@dataclass(frozen=True)
class Schedule:
    tasks: tuple[Task, ...]
    iteration_s: float
    critical_path: tuple[str, ...]

    def task(self, name: str) -> Task:
        return next(task for task in self.tasks if task.name == name)


def simulate(
    pipeline: PipelineGraph,
    placement: Mapping[str, Placement],
    inventory: Inventory,
    costs: CostSource,
) -> Schedule:
    devices = {device.id: device for device in inventory.devices}
    free_at: dict[str, tuple[float, str | None]] = {}
    tasks: dict[str, Task] = {}
    # model nodes that may run at once on CPU slots of one machine divide its cores
    shares = core_shares(pipeline, {node: [devices[i] for i in where.devices] for node, where in placement.items()},
                         host_cores(inventory))
    for node in pipeline.topological_order():
        chosen = placement[node]
        here = [devices[i] for i in chosen.devices]
        ready, after = 0.0, None
        for producer in pipeline.producers(node):
            if producer == SOURCE_NODE:
                continue
            arrival = tasks[producer].end_s + transfer_s(
                costs.output_bytes(producer), [devices[i] for i in placement[producer].devices], here
            )
            if arrival > ready or after is None:
                ready, after = arrival, producer
        start, after = _device_start(chosen.devices, free_at, ready, after)
        end = start + shared_time(costs, node, here, chosen.offloaded, shares.get(node, 1.0))
        tasks[node] = Task(node, "node", chosen.devices, start, end, after)
        for device_id in chosen.devices:
            free_at[device_id] = (end, node)
    for sync in _weight_syncs(pipeline, placement, devices, costs, tasks, free_at):
        tasks[sync.name] = sync
    ordered = tuple(tasks.values())
    last = max(ordered, key=lambda task: task.end_s)
    return Schedule(ordered, last.end_s, _critical_path(tasks, last))


def _device_start(
    device_ids: tuple[str, ...],
    free_at: Mapping[str, tuple[float, str | None]],
    ready: float,
    after: str | None,
) -> tuple[float, str | None]:
    start = ready
    for device_id in device_ids:
        free, holder = free_at.get(device_id, (0.0, None))
        if free > start:
            start, after = free, holder
    return start, after


def _weight_syncs(
    pipeline: PipelineGraph,
    placement: Mapping[str, Placement],
    devices: Mapping[str, Device],
    costs: CostSource,
    tasks: Mapping[str, Task],
    free_at: dict[str, tuple[float, str | None]],
) -> list[Task]:
    syncs: list[Task] = []
    for update in pipeline.nodes_of(UpdateNode):
        work = costs.work(update)
        if work.shape is None or work.model is None:
            continue
        sources = placement[update].devices
        for generate in pipeline.nodes_of(GenerateNode):
            if pipeline.spec.nodes[generate].model != work.model:
                continue
            targets = tuple(d for d in placement[generate].devices if d not in sources)
            if not targets:
                continue  # generator and trainer share the module: nothing to send
            size = weight_bytes(work.shape, work.kind, work.dtype)
            duration = transfer_s(size, [devices[i] for i in sources], [devices[i] for i in targets])
            start, after = _device_start(targets, free_at, tasks[update].end_s, update)
            name = f"sync:{work.model}" if len(syncs) == 0 else f"sync:{work.model}:{generate}"
            syncs.append(Task(name, "sync", targets, start, start + duration, after))
            for device_id in targets:
                free_at[device_id] = (start + duration, name)
    return syncs


def _critical_path(tasks: Mapping[str, Task], last: Task) -> tuple[str, ...]:
    path = [last.name]
    current = last
    while current.after is not None:
        current = tasks[current.after]
        path.append(current.name)
    return tuple(reversed(path))


# ---- memory ------------------------------------------------------------------------------


def device_memory_gb(
    pipeline: PipelineGraph,
    placement: Mapping[str, Placement],
    inventory: Inventory,
    costs: CostSource,
) -> dict[str, float]:
    """Predicted peak memory of every device a node uses, in GB.

    Models live on every device one of their nodes runs on (time-shared when several do);
    their weights and, where they train, gradients and optimizer state stay resident.
    Offloaded weights and each node's activations are there only while it runs, so the
    peak adds the largest of those to the resident memory. A GPU adds its CUDA context.
    """
    kinds = {device.id: device.kind for device in inventory.devices}
    peaks: dict[str, float] = {}
    for (_, device_id), gb in node_call_memory_gb(pipeline, placement, inventory, costs).items():
        peaks[device_id] = max(peaks.get(device_id, 0.0), gb)
    return {device_id: gb + (GPU_CONTEXT_GB if kinds[device_id] == "gpu" else 0.0)
            for device_id, gb in peaks.items()}


def node_call_memory_gb(
    pipeline: PipelineGraph,
    placement: Mapping[str, Placement],
    inventory: Inventory,
    costs: CostSource,
) -> dict[tuple[str, str], float]:
    """Predicted memory the allocator holds during each node call, per (node, device) in GB:
    what stays on the device (every model's weights and state, generation caches, on a GPU
    the cuBLAS workspaces) plus what the call itself needs (on a GPU a model's calls may run
    compiled code, the log-prob passes and generation do, and so may add the compiler's
    timing buffer: counted for every model node there). This is what the profiler
    measures per call on a GPU (``torch.cuda.max_memory_allocated``, no CUDA context)."""
    resident: dict[str, dict[str, float]] = {}
    passing: dict[tuple[str, str], float] = {}
    streams: dict[str, set[str]] = {}
    devices = {device.id: device for device in inventory.devices}
    for node in pipeline.topological_order():
        chosen = placement[node]
        gpu = any(devices[device_id].kind == "gpu" for device_id in chosen.devices)
        memory = costs.memory(node, len(chosen.devices), gpu)
        model = costs.work(node).model
        for device_id in chosen.devices:
            held = resident.setdefault(device_id, {})
            call = memory.transient_gb
            on_gpu = devices[device_id].kind == "gpu"
            if model is not None:
                streams.setdefault(device_id, set()).update(_matmul_streams(pipeline.spec.nodes[node]))
                if on_gpu:
                    call += compile_benchmark_bytes(devices[device_id].l2_cache_mib) / GB
                if chosen.offloaded and on_gpu:
                    call += memory.weights_gb
                else:
                    held[f"{model}:weights"] = memory.weights_gb
                if memory.state_gb:
                    held[f"{model}:state"] = memory.state_gb
                if memory.cache_gb:
                    held[f"{node}:cache"] = memory.cache_gb
            passing[node, device_id] = call
    stays = {
        device_id: sum(held.values())
        + (len(streams.get(device_id, ())) * matmul_workspace_bytes(devices[device_id].arch) / GB
           if devices[device_id].kind == "gpu" else 0.0)
        for device_id, held in resident.items()
    }
    return {(node, device_id): stays[device_id] + call for (node, device_id), call in passing.items()}


def _matmul_streams(node: NodeBase) -> set[str]:
    """The (thread, stream) pairs whose matrix products a model node runs on its device, each
    keeping a cuBLAS workspace there: the worker's compute thread on its default stream;
    autograd's own thread for an update's backward; the side stream on which generation
    captures its decode graphs."""
    streams = {"compute"}
    if node.trains:
        streams.add("backward")
    if isinstance(node, GenerateNode):
        streams.add(f"decode graphs of {node.model}")  # each model's decoder has its own
    return streams
