"""Choose where every node runs: the option set per node, and the search over it.

Options per node (``candidates``), in a fixed order, the natural one first:

- a node of a declared device group (the node's ``device_group`` or its model's) stays
  inside the devices matched to that group: generate and update use all of them
  (data-parallel); score with a reward model, reference_logprob and value may use the
  first 1, 2, 4, ... of them (data-parallel width);
- a model with ``offload_to_cpu`` keeps its weights in host memory, so its inference
  nodes may also be paged onto a GPU the pipeline already uses (time-shared with the
  models there) or, from a GPU group, run on a CPU slot of the same host (CPU offload);
- a node of a model that names no group, and a node without a model (a reward function,
  an advantage), may run next to any placed node (colocation), on a CPU slot, or on one
  free GPU of each type (free GPUs of one type differ only in their links, which matter
  little next to the compute a whole model brings).

Device groups may share devices: besides its own devices, a group that is neither
``exclusive`` nor pinned by ``device_ids`` may run on the first devices of another group of
the same type (one that keeps its own). Every such sharing is searched like the plain match,
and the best of them wins; a shared device holds both groups' models (time-shared), which
the memory check covers.

Objective: the simulated iteration time; ties go to the larger memory headroom (the
smallest share of a device left free), then to the earlier options. A choice is feasible
when every device's predicted peak plus a 10 % reserve fits its memory. Among feasible
choices within ``FEWER_CPU_SLOTS_WITHIN`` of the fastest, the one on the fewest CPU slots wins
(one slot beside the GPUs of a host not counted).

Search: with few combinations every one is tried (exact); otherwise a greedy pass in
topological order followed by local search (change one node at a time, keep any
improvement, until a round changes nothing). Both are deterministic.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from flowrl.devices.inventory import Device, Inventory
from flowrl.devices.matching import Match
from flowrl.errors import PlacementError
from flowrl.graph import PipelineGraph
from flowrl.planner.costs import CostSource
from flowrl.devices.groups import model_group
from flowrl.planner.pushes import push_cycle
from flowrl.planner.simulate import Placement, Schedule, device_memory_gb, simulate


MEMORY_RESERVE = 0.10
"""Share of each device's memory the planner keeps free on top of the predicted peak."""

FEWER_CPU_SLOTS_WITHIN = 0.10
"""A placement on fewer CPU slots wins over a faster one when its predicted step is at most
this much longer. The model times each slot as a device of its own, but the CPU slots of one
host share its cores: on 2 cores, grpo_tiny's score and advantage on a second slot (predicted
2.7 ms faster, 5-6 % of the step depending on the CPU rates measured at start) measured about
7 ms slower per step. The calibrated model's own error is of this size (-6 to -20 % per step
on CPU). One CPU slot on a host where the placement uses a GPU is not counted: beside GPU
workers (whose nodes keep a core busy at most) it shares its host's cores with no other
slot, so it is judged on its predicted time alone, its calls and copies priced as
transfers."""


@dataclass(frozen=True)
class SearchOptions:
    """How hard to search."""

    memory_reserve: float = MEMORY_RESERVE
    """Share of each device's memory kept free on top of the predicted peak. Default 0.10."""
    exact_limit: int = 4096
    """Try every combination when there are at most this many. Default 4096."""
    max_rounds: int = 6
    """Local-search rounds at most (each tries every option of every node). Default 6."""
    move_offloaded: bool = True
    """Let offload_to_cpu models' inference nodes leave their group (see module docs)."""
    share_groups: bool = True
    """Let device groups share devices (see module docs)."""
    max_sharings: int = 64
    """Most matches searched: the plain one and up to this many less one ways of sharing.
    Default 64."""


@dataclass(frozen=True)
class Evaluation:
    placement: dict[str, Placement]
    schedule: Schedule
    memory_gb: dict[str, float]
    feasible: bool
    """The memory fits with its reserve, and no weight pushes wait for each other."""
    headroom: float
    """Smallest share of any used device's memory left free (after nothing is reserved)."""
    deadlock: str | None = None
    """Why the updates' weight pushes would wait for each other (:func:`push_cycle`)."""

    @property
    def key(self) -> tuple[bool, float, float]:
        # round so that float noise never decides between equal schedules
        return (not self.feasible, round(self.schedule.iteration_s, 12), -round(self.headroom, 9))


@dataclass(frozen=True)
class SearchResult:
    best: Evaluation
    options: dict[str, list[Placement]]
    choice: dict[str, int]
    """Node -> index of the chosen option."""
    method: str
    """``exact`` or ``greedy+local``."""
    num_evaluated: int
    shared: dict[str, str] = field(default_factory=dict)
    """Group -> the group whose devices it runs on (shares)."""
    alternative: Alternative | None = None
    """The fastest feasible layout of the other ways of sharing devices, where one differs."""


@dataclass(frozen=True)
class Alternative:
    """A layout of the device groups that was not chosen: how its groups share devices and
    its predicted step."""

    shared: dict[str, str]
    iteration_s: float


def _alternative(results: Sequence[SearchResult], chosen: SearchResult, inventory: Inventory) -> Alternative | None:
    """The fastest feasible result whose nodes are grouped on devices otherwise than
    ``chosen``'s: two ways of sharing may place the nodes alike, or as mirror images (the
    actor on the reference's slot, the reference on the actor's), which differ only in
    which of two alike devices (same kind and name) each group takes."""
    name = {device.id: (device.kind, device.name) for device in inventory.devices}

    def layout(result: SearchResult) -> frozenset[tuple[frozenset[str], tuple[tuple[str, str], ...]]]:
        together: dict[tuple[str, ...], set[str]] = {}
        for node, placed in result.best.placement.items():
            together.setdefault(placed.devices, set()).add(node)
        return frozenset((frozenset(nodes), tuple(sorted(name[d] for d in devices)))
                         for devices, nodes in together.items())

    others = [result for result in results if result.best.feasible and layout(result) != layout(chosen)]
    if not others:
        return None
    fastest = min(others, key=lambda result: result.best.key)
    return Alternative(dict(fastest.shared), fastest.best.schedule.iteration_s)


def sharing_words(group: str, host: str) -> str:
    """A device group that runs on another group's devices, in words."""
    return f"{group} on {host}'s devices"


def sharings(pipeline: PipelineGraph, match: Match, options: SearchOptions) -> Iterator[dict[str, str]]:
    """Ways device groups may share devices (group -> the group it runs on); the plain match
    (no sharing) is not one of them."""
    if not options.share_groups:
        return
    specs = pipeline.spec.devices
    used = [group for group in specs if match.assignment.get(group)]
    movable = [g for g in used if not specs[g].exclusive and specs[g].device_ids is None]
    choices = []
    for group in movable:
        hosts = [other for other in used if other != group and not specs[other].exclusive
                 and specs[other].type == specs[group].type
                 and len(match.assignment[other]) >= len(match.assignment[group])]
        choices.append([None, *hosts])
    # a worker trains one model sharded at a time (the process's default group): two groups
    # of sharded models never share devices
    sharding = [group for _, group in _sharded_training_groups(pipeline)]
    for combination in itertools.product(*choices):
        shared = {group: host for group, host in zip(movable, combination) if host is not None}
        if not shared or any(host in shared for host in shared.values()):  # a host keeps its devices
            continue
        roots = [shared.get(group, group) for group in sharding]
        if len(set(roots)) == len(roots):
            yield shared


def shared_match(match: Match, shared: Mapping[str, str]) -> Match:
    """``match`` with each sharing group on the first devices of its host group."""
    assignment = {
        group: list(match.assignment[shared[group]][: len(devices)]) if group in shared else list(devices)
        for group, devices in match.assignment.items()
    }
    return replace(match, assignment=assignment)


def candidates(
    pipeline: PipelineGraph, inventory: Inventory, match: Match, options: SearchOptions,
    shared: Mapping[str, str] | None = None,
) -> dict[str, list[Placement]]:
    """Every node's options, natural first, without duplicates."""
    spec = pipeline.spec
    cpus = inventory.cpus()
    pinned_devices: list[str] = []  # devices of declared groups, in node order
    result: dict[str, list[Placement]] = {}
    for node in pipeline.topological_order():
        group = _group_of(pipeline, node)
        if group is not None and group in spec.devices:
            for device_id in match.assignment.get(group, [])[:1]:
                if device_id not in pinned_devices:
                    pinned_devices.append(device_id)
    by_id = {device.id: device for device in inventory.devices}
    free_gpus = _free_gpu_representatives(inventory, match)
    for node in pipeline.topological_order():
        node_spec = spec.nodes[node]
        group = _group_of(pipeline, node)
        model = spec.models[node_spec.model] if node_spec.model is not None else None
        offload = bool(model and model.offload_to_cpu)
        found: list[Placement] = []

        def add(device_ids: Sequence[str], note: str) -> None:
            paged = offload and any(by_id[i].kind == "gpu" for i in device_ids)
            item = Placement(tuple(device_ids), paged, note)
            if all(existing.devices != item.devices for existing in found):
                found.append(item)

        if group is not None and group in spec.devices:
            devices = match.assignment.get(group, [])
            label = sharing_words(group, shared[group]) if shared and group in shared else group
            if node_spec.inference:
                for width in _widths(len(devices)):
                    add(devices[:width], f"{label}, width {width} of {len(devices)}")
            elif node_spec.model is None:
                add(devices[:1], f"its device_group {label}")
            else:
                add(devices, label)
            if offload and options.move_offloaded and node_spec.inference:
                host = by_id[devices[0]].host if devices else None
                for device_id in pinned_devices:
                    add([device_id], f"offloaded model paged onto {device_id}")
                for cpu in cpus:
                    if cpu.host == host:
                        add([cpu.id], "cpu offload")
                        break
        else:
            home = match.assignment.get(group, []) if group is not None else []
            for device_id in home[:1]:
                add([device_id], f"its slot ({group})")
            for device_id in pinned_devices:
                add([device_id], f"next to the nodes on {device_id}")
            # a CPU slot no group uses, if there is one: there the node runs beside the others
            spare = [cpu for cpu in cpus if cpu.id not in pinned_devices] or cpus
            for cpu in spare[:1]:
                add([cpu.id], "cpu slot")
            if model is not None:  # a reward function or advantage gains nothing from a GPU
                for device in free_gpus:
                    add([device.id], f"a free {device.name}")
        if not found:
            raise PlacementError(
                f"nodes.{node}: no device can run it (group {group} matched no device); "
                "run `flowrl devices --pipeline FILE` to see why"
            )
        result[node] = found
    return result


def _group_of(pipeline: PipelineGraph, node: str) -> str | None:
    node_spec = pipeline.spec.nodes[node]
    if node_spec.device_group is not None:
        return node_spec.device_group
    if node_spec.model is not None:
        return model_group(pipeline, node_spec.model)
    return None


def _widths(count: int) -> list[int]:
    """1, 2, 4, ... up to ``count``, and ``count`` itself: widths worth trying."""
    widths = [2**power for power in range(int(math.log2(count)) + 1)] if count else []
    if count and count not in widths:
        widths.append(count)
    return widths


def _free_gpu_representatives(inventory: Inventory, match: Match) -> list[Device]:
    taken = {device_id for ids in match.assignment.values() for device_id in ids}
    seen: set[str] = set()
    representatives: list[Device] = []
    for device in inventory.gpus():
        key = device.name
        if device.id not in taken and key not in seen:
            seen.add(key)
            representatives.append(device)
    return representatives


def evaluate(
    pipeline: PipelineGraph,
    placement: dict[str, Placement],
    inventory: Inventory,
    costs: CostSource,
    reserve: float,
) -> Evaluation:
    schedule = simulate(pipeline, placement, inventory, costs)
    memory = device_memory_gb(pipeline, placement, inventory, costs)
    feasible, headroom = fits(memory, inventory, reserve)
    deadlock = push_cycle(pipeline, {node: placed.devices for node, placed in placement.items()})
    return Evaluation(placement, schedule, memory, feasible and deadlock is None, headroom, deadlock)


def fits(memory: Mapping[str, float], inventory: Inventory, reserve: float) -> tuple[bool, float]:
    """CPU slots of one host share its memory, so they are checked together."""
    used: dict[str, tuple[float, float]] = {}
    by_id = {device.id: device for device in inventory.devices}
    for device_id, peak in memory.items():
        device = by_id[device_id]
        key = f"host:{device.host}" if device.kind == "cpu" else device.id
        total, capacity = used.get(key, (0.0, device.capacity_gb))
        used[key] = (total + peak, capacity)
    feasible = all(total * (1 + reserve) <= capacity for total, capacity in used.values())
    headroom = min(((capacity - total) / capacity for total, capacity in used.values()), default=1.0)
    return feasible, headroom


def search(
    pipeline: PipelineGraph,
    inventory: Inventory,
    match: Match,
    costs: CostSource,
    options: SearchOptions | None = None,
) -> SearchResult:
    """The best placement over the plain match and every way of sharing groups' devices;
    ``PlacementError`` (the plain match's) when none fits."""
    options = options or SearchOptions()
    _check_sharding(pipeline, match)
    plain = _search_one(pipeline, inventory, match, costs, options, {})
    best, evaluated = plain, plain.num_evaluated
    results = [plain]
    for shared in itertools.islice(sharings(pipeline, match, options), options.max_sharings - 1):
        result = _search_one(pipeline, inventory, shared_match(match, shared), costs, options, shared)
        evaluated += result.num_evaluated
        results.append(result)
        if result.best.feasible and result.best.key < best.best.key:
            best = result
    # ties after the CPU slots: the key, then the plain match before the sharings, in order
    _, (_, best) = fewest_cpu_slots([(result.best, (index, result)) for index, result in enumerate(results)],
                                    best.best, inventory, lambda item: (item[0].key, item[1][0]))
    if not best.best.feasible:
        raise PlacementError(best.best.deadlock or _memory_message(best.best, inventory, options.memory_reserve, pipeline))
    return replace(best, num_evaluated=evaluated, alternative=_alternative(results, best, inventory))


def _sharded_training_groups(pipeline: PipelineGraph) -> list[tuple[str, str]]:
    """(model, the device group its update trains it in) of every model trained sharded."""
    found = []
    for node, spec in pipeline.spec.nodes.items():
        if spec.trains and spec.model is not None and pipeline.spec.models[spec.model].sharded:
            group = _group_of(pipeline, node)
            if group is not None:
                found.append((spec.model, group))
    return found


def _check_sharding(pipeline: PipelineGraph, match: Match) -> None:
    """Two models trained sharded over groups that the match puts on the same devices (more
    groups than devices) cannot run: a device shards one model at a time."""
    sharded = _sharded_training_groups(pipeline)
    for index, (first, first_group) in enumerate(sharded):
        for second, second_group in sharded[index + 1:]:
            first_devices = match.assignment.get(first_group, [])
            second_devices = match.assignment.get(second_group, [])
            common = [device for device in first_devices if device in second_devices]
            if common and len(first_devices) > 1 and len(second_devices) > 1:
                raise PlacementError(
                    f"models '{first}' and '{second}' train sharded over {first_group} and {second_group}, which "
                    f"share {', '.join(common)} here (too few devices for every group), and a device shards one "
                    "model at a time: ask for fewer devices per group, add devices, or set sharded: false on one")


def _search_one(
    pipeline: PipelineGraph,
    inventory: Inventory,
    match: Match,
    costs: CostSource,
    options: SearchOptions,
    shared: Mapping[str, str],
) -> SearchResult:
    option_sets = candidates(pipeline, inventory, match, options, shared)
    nodes = list(option_sets)
    counter = [0]

    seen: list[tuple[Evaluation, dict[str, int]]] = []

    def score(choice: Mapping[str, int]) -> Evaluation:
        counter[0] += 1
        placement = {node: option_sets[node][choice[node]] for node in nodes}
        evaluation = evaluate(pipeline, placement, inventory, costs, options.memory_reserve)
        seen.append((evaluation, dict(choice)))
        return evaluation

    def rank(evaluation: Evaluation, choice: Mapping[str, int]) -> tuple[object, ...]:
        return (*evaluation.key, tuple(choice[node] for node in nodes))

    total = math.prod(len(option_sets[node]) for node in nodes)
    if total <= options.exact_limit:
        method = "exact"
        best_choice: dict[str, int] = {}
        best: Evaluation | None = None
        for indices in itertools.product(*(range(len(option_sets[n])) for n in nodes)):
            choice = dict(zip(nodes, indices))
            current = score(choice)
            if best is None or rank(current, choice) < rank(best, best_choice):
                best, best_choice = current, choice
        assert best is not None
    else:
        method = "greedy+local"
        best_choice = {node: 0 for node in nodes}
        best = score(best_choice)
        for _ in range(options.max_rounds):
            improved = False
            for node in nodes:  # topological order: the first round is the greedy pass
                for index in range(len(option_sets[node])):
                    if index == best_choice[node]:
                        continue
                    choice = {**best_choice, node: index}
                    current = score(choice)
                    if rank(current, choice) < rank(best, best_choice):
                        best, best_choice, improved = current, choice, True
            if not improved:
                break
    best, best_choice = fewest_cpu_slots(seen, best, inventory, lambda item: rank(*item))
    return SearchResult(best, option_sets, best_choice, method, counter[0], dict(shared))


T = TypeVar("T")


def fewest_cpu_slots(items: Sequence[tuple[Evaluation, T]], best: Evaluation, inventory: Inventory,
                     order: Callable[[tuple[Evaluation, T]], Any]) -> tuple[Evaluation, T]:
    """Of the feasible ``items`` whose step is within ``FEWER_CPU_SLOTS_WITHIN`` of ``best``'s,
    the one on the fewest CPU slots, one slot on each host with a GPU in use not counted (then
    the first by ``order``)."""
    kind_of = {device.id: device.kind for device in inventory.devices}
    host_of = {device.id: device.host for device in inventory.devices}
    limit = best.schedule.iteration_s * (1 + FEWER_CPU_SLOTS_WITHIN)

    def slots(evaluation: Evaluation) -> int:
        used = {d for placed in evaluation.placement.values() for d in placed.devices}
        cpus = {d for d in used if kind_of[d] == "cpu"}
        gpu_hosts = {host_of[d] for d in used if kind_of[d] == "gpu"}
        return len(cpus) - len({host_of[d] for d in cpus} & gpu_hosts)

    near = [item for item in items if item[0].feasible and item[0].schedule.iteration_s <= limit]
    if not best.feasible or not near:
        return next(item for item in items if item[0] is best)
    return min(near, key=lambda item: (slots(item[0]), order(item)))


def _memory_message(best: Evaluation, inventory: Inventory, reserve: float, pipeline: PipelineGraph) -> str:
    over = []
    overflowing: set[str] = set()
    for device_id, peak in sorted(best.memory_gb.items()):
        device = inventory.by_id(device_id)
        assert device is not None
        if peak * (1 + reserve) > device.capacity_gb:
            models = sorted({n for n, p in best.placement.items() if device_id in p.devices})
            overflowing.add(device_id)
            over.append(
                f"{device.label} needs {_gb(peak)} + {reserve:.0%} reserve of "
                f"{_gb(device.capacity_gb)} ({device.memory_gb:g} GiB; runs {', '.join(models)})"
            )
    # an update over several of the overflowing devices could keep 1/N of its training state
    shardable = sorted({
        f"models.{spec.model}.sharded: true" for node, spec in pipeline.spec.nodes.items()
        if spec.trains and spec.model is not None and not pipeline.spec.models[spec.model].sharded
        and node in best.placement and len(best.placement[node].devices) > 1
        and overflowing & set(best.placement[node].devices)})
    # micro_batch_tokens: auto is searched at one row per pass (flowrl.planner.micro_batches)
    auto = [node for node, spec in pipeline.spec.nodes.items()
            if getattr(spec, "micro_batch_tokens", None) == "auto" and node in best.placement
            and overflowing & set(best.placement[node].devices)]
    tried = f" (micro_batch_tokens: auto was tried at one row per pass, its least, for {', '.join(auto)})" if auto else ""
    # bf16 is a hint only where a model on the overflowing devices is still in fp32
    full = sorted({spec.model for node, spec in pipeline.spec.nodes.items()
                   if spec.model is not None and node in best.placement
                   and overflowing & set(best.placement[node].devices)
                   and pipeline.spec.models[spec.model].dtype == "fp32"})
    bf16 = f"bf16 for {', '.join(full)}, " if full else ""
    return (
        "no placement fits in memory; the closest one still overflows: "
        + "; ".join(over)
        + tried
        + f". Use {bf16}gradient_checkpointing, a smaller mini_batch_size or batch, "
        + "".join(f"{hint} (training state split over the update's devices), " for hint in shardable)
        # paging weights to host memory helps only a GPU
        + ("offload_to_cpu for inference-only models, " if any(device.id in overflowing and device.kind == "gpu"
                                                                for device in inventory.devices) else "")
        + "or larger devices"
    )


def _gb(value: float) -> str:
    """``143.9 GB``; ``0.0123 GB`` for what one decimal would show as 0.0."""
    return f"{value:.1f} GB" if value >= 0.1 else f"{value:.3g} GB"
