"""The live side of a run: hosts on workers, their models, and one call per node.

A ``Session`` executes a ``Plan``; it does not decide one. When the scheduler accepts a
new plan, ``apply_plan`` carries it out between two steps (see ``migration.py``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import torch

from flowrl.graph import PipelineGraph
from flowrl.planner.placement import Plan
from flowrl.records import DeviceSample
from flowrl.runtime.calls import EvalCall, NodeReport
from flowrl.runtime.cluster import Cluster, WorkerSlot
from flowrl.runtime.executor import StepExecutor
from flowrl.runtime.host import RoleHost
from flowrl.runtime.migration import Transfer, plan_transfers, stream_offset


@dataclass(frozen=True)
class MigrationResult:
    """What carrying out a new plan cost."""

    seconds: float
    """Driver wall time from the first transfer to the new executor being ready."""
    num_bytes: float
    """State bytes sent worker to worker."""
    transfers: tuple[Transfer, ...]


GENERATORS_FILE = "generators.pt"
"""In a checkpoint's model folder: the sampling RNG state of each other copy, by slot."""


class Session:
    def __init__(self, cluster: Cluster, pipeline: PipelineGraph, plan: Plan, base_dir: Path | None) -> None:
        self.cluster = cluster
        self.pipeline = pipeline
        self.plan = plan
        self.base_dir = base_dir
        self._slots: dict[str, WorkerSlot] = {slot.name: slot for slot in cluster.slots}
        self.hosts: dict[str, Any] = {}
        self._ensure_hosts(_slots_in_use(plan))
        self._groups: dict[str, tuple[str, ...]] = {}
        self._form_groups(plan)
        self.executor = StepExecutor(pipeline, plan, self.hosts, pipeline.spec.runtime.node_timeout_s)

    def _form_groups(self, plan: Plan) -> None:
        """One process group per data-parallel update, over its slots in rank order; a group
        whose members changed is formed again on a new port, one that is gone is left."""
        wanted = {
            node: tuple(plan.slots_of(node))
            for node in self.pipeline.nodes_with_role("update")
            if node in plan.node_slots and len(plan.slots_of(node)) > 1
        }
        for node, members in list(self._groups.items()):
            if wanted.get(node) != members:
                _settle([(self.hosts[slot], "leave_group", (node,)) for slot in members if slot in self.hosts])
                del self._groups[node]
        timeout_s = self.pipeline.spec.runtime.node_timeout_s
        for node, members in wanted.items():
            if self._groups.get(node) == members:
                continue
            address = self._slots[members[0]].host or "127.0.0.1"
            port = self.hosts[members[0]].free_port(address).result(timeout=60)
            joins = [
                self.hosts[slot].form_group(node, rank, len(members), address, port, timeout_s)
                for rank, slot in enumerate(members)
            ]
            for join in joins:
                join.result(timeout=120)
            self._groups[node] = members

    def _ensure_hosts(self, names: list[str], plan: Plan | None = None) -> None:
        """Start a ``RoleHost`` on every slot in ``names`` that has none yet, all at once
        (threads chosen for ``plan``, the one about to run)."""
        plan = plan or self.plan
        runtime = self.pipeline.spec.runtime
        seed = self.pipeline.spec.trainer.seed
        futures = {}
        for name in names:
            if name in self.hosts:
                continue
            slot = self._slots[name]
            threads = runtime.torch_threads or self._default_threads(slot, plan)
            futures[name] = self.cluster.client.submit(
                RoleHost,
                name,
                # a GPU worker sees its one card only (CUDA_VISIBLE_DEVICES), as cuda:0
                "cuda" if slot.kind == "gpu" else "cpu",
                threads,
                seed,
                str(self.base_dir) if self.base_dir else None,
                slot.cores,
                self.pipeline.spec.profiler.sample_interval_s,
                slot.gpu_index,
                actor=True,
                workers=[slot.worker],
                allow_other_workers=False,
                pure=False,
            )
        for name, future in futures.items():
            self.hosts[name] = future.result()

    def _retune_threads(self, plan: Plan) -> None:
        """Hosts that already run keep their threads unless the plan changes what suits
        them: a split that starts (or ends) running parts at the same time."""
        if self.pipeline.spec.runtime.torch_threads or bool(plan.node_shards) == bool(self.plan.node_shards):
            return
        _settle([(self.hosts[name], "set_threads", (self._default_threads(self._slots[name], plan),)) for name in self.hosts])

    def _default_threads(self, slot: WorkerSlot, plan: Plan) -> int:
        """Torch threads of a worker when the file does not say.

        A pinned worker uses its own cores. Otherwise nodes of one step mostly run one after
        another (rollout -> ref -> update), so each worker may use every core of the host
        (measured on 2 cores: 0.105 s/step with one thread per worker, 0.085 s with two)
        unless the plan splits a node over workers: then parts run at the same time and
        2 workers x 2 threads on 2 cores made the split reference forward 10x slower.
        """
        if slot.cores:
            return len(slot.cores)
        cores = max(1, os.cpu_count() or 1)
        share = max(1, cores // sum(1 for other in self._slots.values() if other.host == slot.host))
        if slot.kind == "gpu":
            return min(4, share)  # the card computes; a few threads feed it and run its CPU-side work
        return share if plan.node_shards else cores

    def load_models(self) -> list[dict[str, Any]]:
        """Load every model on every slot that holds it, all slots at once.

        Parts of a split generate node sample with their own RNG stream (seed + part), so
        they do not draw the same random numbers for different prompts."""
        seed = self.pipeline.spec.trainer.seed
        calls = []
        for model, slots in self.plan.model_slots.items():
            spec = self.pipeline.spec.models[model]
            for slot in slots:
                offset = stream_offset(self.pipeline, self.plan, model, slot)
                calls.append(self.hosts[slot].load_model(model, spec, seed + offset))
        return [call.result() for call in calls]

    def run_step(
        self, step: int, prompts: Sequence[Any], kl_coefs: dict[str, float] | None = None
    ) -> dict[str, NodeReport]:
        return self.executor.run_step(step, prompts, kl_coefs)

    def evaluate(self, call: EvalCall, timeout_s: float) -> list[NodeReport]:
        """Run an evaluation on the generate node's workers, each on its consecutive share
        of the prompts, all at once; one report per worker, in prompt order."""
        generate = next(node for node in self.pipeline.topological_order()
                        if self.pipeline.spec.nodes[node].role == "generate")
        slots = self.plan.slots_of(generate)
        parts = [call.examples[rows] for rows in _even_parts(len(call.examples), len(slots))]
        futures = [self.hosts[slot].evaluate(replace(call, examples=part)) for slot, part in zip(slots, parts) if part]
        return [future.result(timeout=timeout_s) for future in futures]

    def apply_plan(self, plan: Plan) -> MigrationResult:
        """Move roles to ``plan``'s slots: every host that gains a model pulls its state
        (weights, optimizer, RNG) straight from the host that has it, all hosts at once;
        then hosts that lost a model drop it. Batches of finished steps are not needed
        again, so nothing else moves."""
        started = time.perf_counter()
        alive = {str(info["name"]) for info in self.cluster.client.scheduler_info(n_workers=-1)["workers"].values()}
        alive = {slot.name for slot in self.cluster.slots if str(slot.worker) in alive}
        transfers = plan_transfers(self.pipeline, self.plan, plan, alive)
        self._ensure_hosts(_slots_in_use(plan), plan)
        self._retune_threads(plan)
        seed = self.pipeline.spec.trainer.seed
        calls = [
            self.hosts[t.slot].adopt_model(
                t.model,
                self.pipeline.spec.models[t.model],
                seed + t.seed_offset,
                tuple((self.hosts[source], parts) for source, parts in t.sources),
                t.reseed,
            )
            for t in transfers
        ]
        num_bytes = sum(call.result(timeout=self.executor.node_timeout_s)["bytes"] for call in calls)
        _settle(
            [
                (self.hosts[slot], "drop_model", (model,))
                for model, slots in self.plan.model_slots.items()
                for slot in slots
                if slot not in plan.model_slots.get(model, [])
            ]
        )
        self._form_groups(plan)
        self.plan = plan
        self.executor = StepExecutor(self.pipeline, plan, self.hosts, self.executor.node_timeout_s)
        return MigrationResult(time.perf_counter() - started, num_bytes, tuple(transfers))

    @property
    def num_slots_in_use(self) -> int:
        return len(_slots_in_use(self.plan))

    def set_shares(self, shares: dict[str, list[float]]) -> None:
        """New row shares for split nodes, from the next step on (nothing moves)."""
        self.plan = replace(self.plan, node_shares={**self.plan.node_shares, **shares})
        self.executor = StepExecutor(self.pipeline, self.plan, self.hosts, self.executor.node_timeout_s)

    def sample_devices(self) -> list[DeviceSample]:
        calls = [host.sample_device() for host in self.hosts.values()]
        return [call.result(timeout=30) for call in calls]

    def trained_models(self) -> dict[str, str]:
        """Model -> the slot of its update node (the copy whose weights are current)."""
        return {
            self.pipeline.spec.nodes[node].model: self.plan.node_slots[node]
            for node in self.pipeline.nodes_with_role("update")
        }

    def save_models(self, directory: Path, with_state: bool) -> None:
        """Each trained model is written by the worker that holds it, all at once, its weights
        split into files of at most ``trainer.max_shard_size``. With ``with_state``, the
        sampling RNG of every other copy goes to ``generators.pt`` beside it, so a resumed run
        samples as an uninterrupted one would."""
        by_slot: dict[str, list[str]] = {}
        for model, slot in self.trained_models().items():
            by_slot.setdefault(slot, []).append(model)
        # Actor calls run concurrently on their workers; wait for all of them.
        shard_size = self.pipeline.spec.trainer.max_shard_size
        calls = [
            self.hosts[slot].save_models(str(directory), models, with_state, shard_size)
            for slot, models in by_slot.items()
        ]
        copies = self._other_copies() if with_state else []
        exports = [(model, slot, self.hosts[slot].export_state(model, ("generator",))) for model, slot in copies]
        for call in calls:
            call.result(timeout=600)
        generators: dict[str, dict[str, Any]] = {}
        for model, slot, export in exports:
            generators.setdefault(model, {})[slot] = export.result(timeout=600)["generator"]
        for model, states in generators.items():
            torch.save(states, Path(directory) / model / GENERATORS_FILE)

    def _copies(self) -> list[tuple[str, str, bool]]:
        """(model, slot, is the training copy) of every copy of every trained model."""
        return [
            (model, slot, slot == trainer_slot)
            for model, trainer_slot in self.trained_models().items()
            for slot in self.plan.model_slots.get(model, [trainer_slot])
        ]

    def _other_copies(self) -> list[tuple[str, str]]:
        """(model, slot) of every copy of a trained model that is not the training copy."""
        return [(model, slot) for model, slot, training in self._copies() if not training]

    def snapshot(self) -> dict[str, dict[str, dict[str, Any]]]:
        """The trained models' state, pulled to the driver: model -> slot -> parts. The
        training copy gives weights, optimizer and sampling RNG; every other copy of the
        model its own sampling RNG."""
        calls = []
        for model, slot, training in self._copies():
            parts = ("weights", "optimizer", "generator") if training else ("generator",)
            calls.append((model, slot, self.hosts[slot].export_state(model, parts)))
        taken: dict[str, dict[str, dict[str, Any]]] = {}
        for model, slot, call in calls:
            taken.setdefault(model, {})[slot] = call.result(timeout=600)
        return taken

    def restore(self, snapshot: dict[str, dict[str, dict[str, Any]]]) -> None:
        """Put a :meth:`snapshot` back on the hosts of this session's plan (whose training
        copy may sit on another slot than the snapshot's, after a re-plan)."""
        calls = []
        for model, slot, training in self._copies():
            saved = snapshot[model]
            trained = next(parts for parts in saved.values() if "weights" in parts)
            parts = dict(trained) if training else {"weights": trained["weights"]}
            if "generator" in saved.get(slot, {}):
                parts["generator"] = saved[slot]["generator"]
            calls.append(self.hosts[slot].restore_state(model, parts))
        for call in calls:
            call.result(timeout=600)

    def load_checkpoint(self, directory: Path) -> None:
        """Restore every copy of each trained model from a checkpoint directory: the training
        copy whole, the others their weights and their own sampling RNG (``generators.pt``)."""
        calls = [
            self.hosts[slot].load_models(str(directory), [model], None if training else ("weights",))
            for model, slot, training in self._copies()
        ]
        for call in calls:
            call.result(timeout=600)
        states: dict[str, dict[str, Any]] = {}
        restores = []
        for model, slot in self._other_copies():
            if model not in states:
                saved = Path(directory) / model / GENERATORS_FILE
                states[model] = torch.load(saved, weights_only=True) if saved.is_file() else {}
            if slot in states[model]:  # a copy on a slot the checkpoint did not know keeps its seed
                restores.append(self.hosts[slot].restore_state(model, {"generator": states[model][slot]}))
        for call in restores:
            call.result(timeout=600)

    def close(self) -> None:
        self.executor.close()

    def release(self, lost: set[str] | frozenset[str] = frozenset()) -> None:
        """Close, and free the models of hosts whose workers outlive this session (a new
        session takes over after a lost worker). Hosts of ``lost`` slots died with their
        worker: calling them would only wait for a connection that cannot succeed."""
        self.close()
        _settle([(host, "drop_all", ()) for slot, host in self.hosts.items() if slot not in lost])
        self.hosts.clear()


def _even_parts(count: int, num_parts: int) -> list[slice]:
    """``count`` rows in ``num_parts`` consecutive parts, the first ``count % num_parts`` one longer."""
    size, extra = divmod(count, num_parts)
    parts, start = [], 0
    for index in range(num_parts):
        stop = start + size + (1 if index < extra else 0)
        parts.append(slice(start, stop))
        start = stop
    return parts


def _slots_in_use(plan: Plan) -> list[str]:
    return sorted({slot for node in plan.node_slots for slot in plan.slots_of(node)})


def _settle(calls: list[tuple[Any, str, tuple[Any, ...]]]) -> None:
    """Make clean-up calls (host, method, args) and wait for them; a host whose worker died
    has nothing left to clean up, so its failures are ignored."""
    pending = []
    for host, method, args in calls:
        try:
            # even looking a method up on the handle of a lost actor raises
            pending.append(getattr(host, method)(*args))
        except Exception:  # the worker is gone (killed, lost): its state went with it
            continue
    for call in pending:
        try:
            call.result(timeout=60)
        except Exception:
            continue
