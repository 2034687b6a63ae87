"""The live side of a run: hosts on workers, their models, and one call per node.

A ``Session`` executes a ``Plan``; it does not decide one. When the scheduler accepts a
new plan, ``apply_plan`` carries it out between two steps (see ``migration.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import torch

from flowrl.errors import ClusterError
from flowrl.graph import PipelineGraph
from flowrl.planner.placement import Plan
from flowrl.records import DeviceSample
from flowrl.runtime.calls import EvalCall, HeldOutScoreCall, NodeReport, store_key
from flowrl.runtime.cluster import Cluster, WorkerSlot, registered_workers
from flowrl.runtime.collective import weights_group
from flowrl.runtime.executor import StepExecutor
from flowrl.runtime.threads import call_threads
from flowrl.runtime.host import RoleHost
from flowrl.runtime.migration import Transfer, plan_transfers, stream_offset
from flowrl.runtime.packing import unpack
from flowrl.runtime.waiting import gather
from flowrl.spec.schema import AdvantageNode, GenerateNode, ScoreNode, UpdateNode, pass_tokens


@dataclass(frozen=True)
class MigrationResult:
    """What carrying out a new plan cost."""

    seconds: float
    """Driver wall time from the first transfer to the new executor being ready."""
    num_bytes: float
    """State bytes sent worker to worker."""
    transfers: tuple[Transfer, ...]


HOST_START_S = 120.0
"""Deadline for starting role hosts; a worker that leaves is noticed at once (see ``gather``)."""
GENERATORS_FILE = "generators.pt"
"""In a checkpoint's model folder: the sampling RNG state of each other copy, by slot."""


class Session:
    def __init__(self, cluster: Cluster, pipeline: PipelineGraph, plan: Plan, base_dir: Path | None) -> None:
        self.cluster = cluster
        self.pipeline = pipeline
        self.plan = plan
        self.base_dir = base_dir
        self._slots: dict[str, WorkerSlot] = {slot.name: slot for slot in cluster.slots}
        self.addresses = cluster.addresses()
        """Slot -> the worker this session's hosts live on; another one there means it was lost."""
        self.hosts: dict[str, Any] = {}
        self._groups: dict[str, tuple[str, ...]] = {}
        self.executor = self._executor(plan, pipeline.spec.runtime.node_timeout_s)
        self._ensure_hosts(_slots_in_use(plan))
        self._form_groups(plan)

    def gather(self, calls: list[tuple[str, Any]], timeout_s: float, what: str, setting: str = "") -> list[Any]:
        """Results of (slot, future) calls; a lost worker or the deadline raises at once
        (``runtime.waiting.gather``; ``setting``: what sets the deadline, for its message)."""
        return gather(calls, timeout_s, what, self.addresses, self.cluster.addresses, setting)

    def gather_long(self, calls: list[tuple[str, Any]], what: str) -> list[Any]:
        """``gather`` of calls that load, save or move models: as long as a node may run."""
        return self.gather(calls, self.executor.node_timeout_s, what, "runtime.node_timeout_s")

    def _weight_groups(self, plan: Plan) -> dict[str, tuple[str, ...]]:
        """With ``runtime.weight_sync: collective``, per update node whose model has copies on
        other workers: the group of its trainer (rank 0) and those workers."""
        if self.pipeline.spec.runtime.weight_sync != "collective":
            return {}
        groups = {}
        for node in self.pipeline.nodes_of(UpdateNode):
            model = self.pipeline.spec.nodes[node].model
            if node in plan.node_slots and model is not None and plan.weight_peers(node, model):
                groups[weights_group(node)] = (plan.slots_of(node)[0], *plan.weight_peers(node, model))
        return groups

    def _wanted_groups(self, plan: Plan) -> dict[str, tuple[str, ...]]:
        """Group name -> member slots in rank order: one per data-parallel update (over its
        slots) and one per weight broadcast (``_weight_groups``)."""
        wanted = {
            node: tuple(plan.slots_of(node))
            for node in self.pipeline.nodes_of(UpdateNode)
            if node in plan.node_slots and len(plan.slots_of(node)) > 1
        }
        wanted.update(self._weight_groups(plan))
        return wanted

    def _sharded(self, node: str) -> bool:
        """Whether ``node`` is an update whose model trains sharded (``ModelSpec.sharded``)."""
        model = self.pipeline.spec.nodes[node].model if node in self.pipeline.spec.nodes else None
        return model is not None and self.pipeline.spec.models[model].sharded

    def _leave_groups(self, plan: Plan) -> None:
        """Leave every group whose members ``plan`` changes or drops, all members at once (a
        sharded model gathers its optimizer state as its group goes, see ``RoleHost.leave_group``)."""
        wanted = self._wanted_groups(plan)
        for node, members in list(self._groups.items()):
            if wanted.get(node) == members:
                continue
            del self._groups[node]
            if self._sharded(node):
                # its ranks gather the model's whole optimizer state: a failure must not pass
                # unnoticed (the run recovers from its snapshot instead)
                self.gather_long([(slot, self.hosts[slot].leave_group(node)) for slot in members if slot in self.hosts],
                                 f"gathering the state of {node}'s sharded model")
            else:
                _settle([(self.hosts[slot], "leave_group", (node,)) for slot in members if slot in self.hosts])

    def _form_groups(self, plan: Plan) -> None:
        """Form the groups ``plan`` needs (``_wanted_groups``) that do not exist yet, each on a
        new port, after leaving those it changes. torch's sharding works over the process's
        default group, and a worker has one: two sharded updates on one worker are refused."""
        self._leave_groups(plan)
        timeout_s = self.pipeline.spec.runtime.node_timeout_s
        sharding = {node: members for node, members in self._groups.items() if self._sharded(node)}
        for node, members in self._wanted_groups(plan).items():
            if self._groups.get(node) == members:
                continue
            sharded = self._sharded(node)
            if sharded:
                for other, slots in sharding.items():
                    if set(slots) & set(members):
                        raise ClusterError(
                            f"updates '{other}' and '{node}' both train a model sharded over worker "
                            f"{sorted(set(slots) & set(members))[0]}, and a worker shards one model at a time: "
                            "give the two models device groups of their own (exclusive: true), or set "
                            "sharded: false on one")
                sharding[node] = members
            address = self._slots[members[0]].host or "127.0.0.1"
            port = self.gather([(members[0], self.hosts[members[0]].free_port(address))], 60, "a free port")[0]
            joins = [
                (slot, self.hosts[slot].form_group(node, rank, len(members), address, port, timeout_s, sharded))
                for rank, slot in enumerate(members)
            ]
            self.gather(joins, 120, f"forming the group of {node}")
            self._groups[node] = members

    def _ensure_hosts(self, names: list[str]) -> None:
        """Start a ``RoleHost`` on every slot in ``names`` that has none yet, all at once."""
        runtime = self.pipeline.spec.runtime
        seed = self.pipeline.spec.trainer.seed
        futures = {}
        for name in names:
            if name in self.hosts:
                continue
            slot = self._slots[name]
            threads = runtime.torch_threads or self._default_threads(slot)
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
        # A stopped (hung) worker stays registered: only the deadline finds it, and a host starts
        # in under a second on a warm worker, so the node deadline bounds this one too.
        deadline_s = min(HOST_START_S, runtime.node_timeout_s)
        started = self.gather(list(futures.items()), deadline_s, "starting role hosts")
        self.hosts.update(zip(futures, started))

    def _executor(self, plan: Plan, node_timeout_s: float) -> StepExecutor:
        return StepExecutor(self.pipeline, plan, self.hosts, node_timeout_s, self.gather,
                            threads=self._call_threads(plan))

    def _call_threads(self, plan: Plan) -> dict[tuple[str, str], int]:
        """(node, slot) -> torch threads of that call on an unpinned CPU worker
        (``flowrl.runtime.threads``): none when the file sets ``runtime.torch_threads``."""
        if self.pipeline.spec.runtime.torch_threads:
            return {}
        shared: dict[str, set[str]] = {}
        for name, slot in self._slots.items():
            if slot.kind == "cpu" and not slot.cores:
                shared.setdefault(slot.host, set()).add(name)
        threads: dict[tuple[str, str], int] = {}
        for names in shared.values():
            cores = self.cluster.cores_of(min(names))  # the slots of one host: its cores
            threads.update(call_threads(self.pipeline, plan, cores, names))
        return threads

    def _default_threads(self, slot: WorkerSlot) -> int:
        """Torch threads of a worker when the file does not say, for what it does outside
        node calls (loading and moving models, evaluations); each node call on an unpinned
        CPU worker brings its own (``_call_threads``). A pinned worker uses its own cores; an
        unpinned CPU worker every core of its host (those calls run while no node does); a
        GPU worker a few, the card computes."""
        if slot.cores:
            return len(slot.cores)
        cores = self.cluster.cores_of(slot.name)
        if slot.kind == "gpu":
            share = max(1, cores // sum(1 for other in self._slots.values() if other.host == slot.host))
            return min(4, share)  # a few threads feed the card and run its CPU-side work
        return cores

    def load_models(self) -> list[dict[str, Any]]:
        """Load every model on every slot that holds it, all slots at once; each copy's
        ``load_model`` report with ``trains``: whether an update trains that copy.

        Parts of a split generate node sample with their own RNG stream (seed + part), so
        they do not draw the same random numbers for different prompts."""
        seed = self.pipeline.spec.trainer.seed
        calls = []
        training = self._training_slots(self.plan)
        for model, slots in self.plan.model_slots.items():
            spec = self.pipeline.spec.models[model]
            for slot in slots:
                offset = stream_offset(self.pipeline, self.plan, model, slot)
                calls.append((slot, self.hosts[slot].load_model(model, spec, seed + offset, adapter_seed=seed)))
        infos = self.gather_long(calls, "loading models")
        return [{**info, "trains": slot in training.get(info["model"], [])} for (slot, _), info in zip(calls, infos)]

    def run_step(
        self, step: int, prompts: Sequence[Any], kl_coefs: dict[str, float] | None = None, profile_dir: str = ""
    ) -> dict[str, NodeReport]:
        return self.executor.run_step(step, prompts, kl_coefs, profile_dir)

    def samples(self, step: int, rows: int, timeout_s: float) -> list[dict[str, Any]]:
        """The first ``rows`` rows of step ``step``'s rollout with their rewards and
        advantages, each read where its node left it (before the next step drops them): per
        row the rollout's prompt, completion and answer, ``rewards`` by score node and, from a
        per-sequence estimator, ``advantage``."""
        generate = self.pipeline.nodes_of(GenerateNode)
        if not generate or rows < 1:
            return []
        rollout = generate[0]
        scores = [node for node in self.pipeline.nodes_of(ScoreNode) if self.pipeline.rollout_of(node) == rollout]
        advantages = [node for node in self.pipeline.nodes_of(AdvantageNode)
                      if self.pipeline.rollout_of(node) == rollout]
        nodes = [rollout, *scores, *advantages[:1]]
        holders = {node: self.plan.slots_of(node)[0] for node in nodes}  # shard 0 holds a split node's whole output
        futures = [(holders[node], self.hosts[holders[node]].samples(store_key(step, node), rows)) for node in nodes]
        parts = dict(zip(nodes, self.gather(futures, timeout_s, "reading samples")))
        merged: list[dict[str, Any]] = []
        for index, row in enumerate(parts[rollout]):
            entry: dict[str, Any] = {**row, "rewards": {node: parts[node][index]["reward"] for node in scores
                                                       if index < len(parts[node])}}
            for node in advantages[:1]:
                if index < len(parts[node]):
                    entry["advantage"] = parts[node][index]["advantage"]
            merged.append(entry)
        return merged

    def evaluate(self, call: EvalCall, timeout_s: float) -> list[NodeReport]:
        """Run an evaluation on the generate node's workers, each on its consecutive share
        of the prompts, all at once; one report per worker, in prompt order."""
        futures = [(slot, self.hosts[slot].evaluate(replace(call, examples=call.examples[rows])))
                   for slot, rows in self._eval_shares(len(call.examples))]
        return self.gather(futures, timeout_s, "evaluation")

    def _eval_shares(self, num_examples: int) -> list[tuple[str, slice]]:
        """(slot, rows) of the generate node's workers that get a share of the held-out
        prompts: consecutive, the first ``num_examples % workers`` one longer, none empty."""
        slots = self.plan.slots_of(self.pipeline.nodes_of(GenerateNode)[0])
        return [(slot, rows) for slot, rows in zip(slots, _even_parts(num_examples, len(slots)))
                if rows.stop > rows.start]

    def score_held_out(self, step: int, nodes: Sequence[str], n: int, num_examples: int,
                       timeout_s: float) -> list[NodeReport]:
        """Score the completions that :meth:`evaluate` (with ``keep``) left on the generate
        node's workers with the reward models of score ``nodes``, each on the worker that
        holds it (it fetches them from their workers, in prompt order); one report per node."""
        sources = [slot for slot, _ in self._eval_shares(num_examples)]  # as :meth:`evaluate` shared them
        futures = []
        for node in nodes:
            spec = self.pipeline.spec.nodes[node]
            assert isinstance(spec, ScoreNode) and spec.model is not None
            slot = self.plan.slots_of(node)[0]
            call = HeldOutScoreCall(step, node, spec.model, pass_tokens(spec.micro_batch_tokens),
                                    tuple(None if source == slot else self.hosts[source] for source in sources), n,
                                    retokenize=spec.retokenize)
            futures.append((slot, self.hosts[slot].score_held_out(call)))
        return self.gather(futures, timeout_s, "evaluation's reward models")

    def apply_plan(self, plan: Plan) -> MigrationResult:
        """Move roles to ``plan``'s slots: every host that gains a model pulls its state
        (weights, optimizer, RNG) straight from the host that has it, all hosts at once;
        then hosts that lost a model drop it. Batches of finished steps are not needed
        again, so nothing else moves."""
        started = time.perf_counter()
        alive = {str(info["name"]) for info in registered_workers(self.cluster.client).values()}
        alive = {slot.name for slot in self.cluster.slots if str(slot.worker) in alive}
        transfers = plan_transfers(self.pipeline, self.plan, plan, alive)
        # first: a sharded model whose group changes gathers its whole state on its ranks,
        # so that any of them can hand it over below
        self._leave_groups(plan)
        self._ensure_hosts(_slots_in_use(plan))
        seed = self.pipeline.spec.trainer.seed
        calls = [
            (t.slot, self.hosts[t.slot].adopt_model(
                t.model,
                self.pipeline.spec.models[t.model],
                seed + t.seed_offset,
                tuple((self.hosts[source], parts) for source, parts in t.sources),
                t.reseed,
                adapter_seed=seed,
            ))
            for t in transfers
        ]
        num_bytes = sum(done["bytes"] for done in self.gather_long(calls, "moving models"))
        trained_before, trained_after = self._training_slots(self.plan), self._training_slots(plan)
        _settle(
            [
                (self.hosts[slot], "drop_model", (model,))
                for model, slots in self.plan.model_slots.items()
                for slot in slots
                if slot not in plan.model_slots.get(model, [])
            ]
            + [
                (self.hosts[slot], "drop_training", (model,))
                for model, slots in trained_before.items()
                for slot in slots
                if slot not in trained_after.get(model, []) and slot in plan.model_slots.get(model, [])
            ]
        )
        self._form_groups(plan)
        self.plan = plan
        self.executor = self._executor(plan, self.executor.node_timeout_s)
        return MigrationResult(time.perf_counter() - started, num_bytes, tuple(transfers))

    def _training_slots(self, plan: Plan) -> dict[str, list[str]]:
        """Model -> the slots of the update node that trains it in ``plan`` (its ranks)."""
        slots: dict[str, list[str]] = {}
        for node in self.pipeline.nodes_of(UpdateNode):
            model = self.pipeline.spec.nodes[node].model
            assert model is not None  # the schema requires an update node's model
            slots.setdefault(model, []).extend(plan.slots_of(node))
        return slots

    @property
    def num_slots_in_use(self) -> int:
        return len(_slots_in_use(self.plan))

    def set_shares(self, shares: dict[str, list[float]]) -> None:
        """New row shares for split nodes, from the next step on (nothing moves)."""
        self.plan = replace(self.plan, node_shares={**self.plan.node_shares, **shares})
        self.executor = self._executor(self.plan, self.executor.node_timeout_s)

    def sample_devices(self) -> list[DeviceSample]:
        return self.gather([(slot, host.sample_device()) for slot, host in self.hosts.items()], 30, "sampling devices")

    def trained_models(self) -> dict[str, str]:
        """Model -> the slot of its update node (the copy whose weights are current)."""
        trained = {}
        for node in self.pipeline.nodes_of(UpdateNode):
            model = self.pipeline.spec.nodes[node].model
            assert model is not None  # the schema requires an update node's model
            trained[model] = self.plan.node_slots[node]
        return trained

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
            (slot, self.hosts[slot].save_models(str(directory), models, with_state, shard_size))
            for slot, models in by_slot.items()
        ]
        copies = self._other_copies() if with_state else []
        exports = [(slot, self.hosts[slot].export_state(model, self._copy_parts(model, slot))) for model, slot in copies]
        self.gather_long(calls, "saving models")
        generators: dict[str, dict[str, Any]] = {}
        for (model, slot), export in zip(copies, self.gather_long(exports, "saving sampling states")):
            generators.setdefault(model, {})[slot] = export["generator"]
        for model, states in generators.items():
            torch.save(states, Path(directory) / model / GENERATORS_FILE)

    def _copies(self) -> list[tuple[str, str, bool]]:
        """(model, slot, is the training copy) of every copy of every trained model."""
        return [
            (model, slot, slot == trainer_slot)
            for model, trainer_slot in self.trained_models().items()
            for slot in self.plan.model_slots.get(model, [trainer_slot])
        ]

    def _ranks(self) -> set[tuple[str, str]]:
        """(model, slot) of each data-parallel rank of a trained model other than the training
        copy: it steps the same optimizer, so it needs the optimizer state and update count
        too (the count seeds the mini-batch shuffle), but keeps its own sampling RNG."""
        ranks: set[tuple[str, str]] = set()
        for node in self.pipeline.nodes_of(UpdateNode):
            model = self.pipeline.spec.nodes[node].model
            assert model is not None  # the schema requires an update node's model
            ranks.update((model, slot) for slot in self.plan.slots_of(node)[1:])
        return ranks

    def _copy_parts(self, model: str, slot: str) -> tuple[str, ...]:
        """What a copy that is not the training one exports with a snapshot or checkpoint: its
        sampling RNG; a rank of a model trained sharded also takes part in gathering the
        training copy's whole optimizer state (``optimizer_peer``)."""
        sharded = self.pipeline.spec.models[model].sharded and (model, slot) in self._ranks()
        return ("generator", "optimizer_peer") if sharded else ("generator",)

    def _other_copies(self) -> list[tuple[str, str]]:
        """(model, slot) of every copy of a trained model that is not the training copy."""
        return [(model, slot) for model, slot, training in self._copies() if not training]

    def snapshot(self) -> dict[str, dict[str, dict[str, Any]]]:
        """The trained models' state, pulled to the driver: model -> slot -> parts. The
        training copy gives weights, optimizer and sampling RNG; every other copy of the
        model its own sampling RNG."""
        return self.stage_snapshot().result()

    def stage_snapshot(self) -> "PendingSnapshot":
        """Have every host copy its part of a :meth:`snapshot` aside, wait for that, and start
        pulling the copies to the driver: the steps after go on while they travel."""
        staged = []
        for model, slot, training in self._copies():
            parts = ("weights", "optimizer", "generator") if training else self._copy_parts(model, slot)
            staged.append((model, slot, self.hosts[slot].stage_state(model, parts)))
        self.gather_long([(slot, call) for _, slot, call in staged], "taking a snapshot")
        return PendingSnapshot(self, [(model, slot, self.hosts[slot].take_staged(model)) for model, slot, _ in staged])

    def restore(self, snapshot: dict[str, dict[str, dict[str, Any]]]) -> None:
        """Put a :meth:`snapshot` back on the hosts of this session's plan (whose training
        copy may sit on another slot than the snapshot's, after a re-plan)."""
        calls = []
        ranks = self._ranks()
        for model, slot, training in self._copies():
            saved = snapshot[model]
            trained = next(parts for parts in saved.values() if "weights" in parts)
            if training:
                parts = dict(trained)
            elif (model, slot) in ranks:
                parts = {key: value for key, value in trained.items() if key != "generator"}
            else:
                parts = {"weights": trained["weights"]}
            if "generator" in saved.get(slot, {}):
                parts["generator"] = saved[slot]["generator"]
            calls.append((slot, self.hosts[slot].restore_state(model, parts)))
        self.gather_long(calls, "restoring models")

    def load_checkpoint(self, directory: Path) -> None:
        """Restore every copy of each trained model from a checkpoint directory: the training
        copy whole, its data-parallel ranks the weights and the optimizer state, the others
        their weights; every copy but the training one its own sampling RNG (``generators.pt``)."""
        ranks = self._ranks()
        calls = [
            (slot, self.hosts[slot].load_models(
                str(directory), [model],
                None if training else ("weights", "optimizer") if (model, slot) in ranks else ("weights",)))
            for model, slot, training in self._copies()
        ]
        self.gather_long(calls, "loading a checkpoint")
        states: dict[str, dict[str, Any]] = {}
        restores = []
        for model, slot in self._other_copies():
            if model not in states:
                saved = Path(directory) / model / GENERATORS_FILE
                states[model] = torch.load(saved, weights_only=True) if saved.is_file() else {}
            if slot in states[model]:  # a copy on a slot the checkpoint did not know keeps its seed
                restores.append((slot, self.hosts[slot].restore_state(model, {"generator": states[model][slot]})))
        self.gather_long(restores, "restoring sampling states")

    def close(self) -> None:
        self.executor.close()

    def release(self, lost: set[str] | frozenset[str] = frozenset()) -> None:
        """Close, and free the models of hosts whose workers outlive this session (a new
        session takes over after a lost worker). Hosts of ``lost`` slots died with their
        worker: calling them would only wait for a connection that cannot succeed."""
        self.close()
        _settle([(host, "drop_all", ()) for slot, host in self.hosts.items() if slot not in lost])
        self.hosts.clear()


class PendingSnapshot:
    """A snapshot whose copies are on their way to the driver (``Session.stage_snapshot``)."""

    def __init__(self, session: Session, fetches: list[tuple[str, str, Any]]) -> None:
        self._session = session
        self._fetches = fetches

    def result(self) -> dict[str, dict[str, dict[str, Any]]]:
        """model -> slot -> parts, once every copy arrived; raises like ``Session.gather``
        when a worker holding one was lost first."""
        results = self._session.gather_long([(slot, call) for _, slot, call in self._fetches], "taking a snapshot")
        taken: dict[str, dict[str, dict[str, Any]]] = {}
        for (model, slot, _), result in zip(self._fetches, results):
            taken.setdefault(model, {})[slot] = unpack(result)
        return taken


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
