"""Runs one step of the pipeline on the hosts.

The driver sends every node call of the step at once, in dependency order, and then
collects the reports. Each host waits for a call's inputs itself (see ``host.py``), so
the step costs one round trip from the driver, not one per dependency level, and
independent nodes on different hosts run at the same time. Batches never come back
here: the consumer's host fetches them from the producer's host.

    driver: run_node(call) for every node -> [host actors compute as data arrives] -> reports
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Sequence

from flowrl.algorithms.lr_schedule import scheduled_lr
from flowrl.errors import FlowrlError, NodeTimeout
from flowrl.graph import PipelineGraph
from flowrl.planner.placement import Plan
from flowrl.runtime.calls import InputRef, NodeCall, NodeReport, store_key
from flowrl.spec.schema import SOURCE_NODE, GenerateNode, NodeBase, UpdateNode
from flowrl.runtime.waiting import gather, peer_failed

Gather = Callable[[list[tuple[str, Any]], float, str], list[Any]]
"""(slot, future) calls, a deadline, what they are -> their results (``waiting.gather``)."""


def _plain_gather(calls: list[tuple[str, Any]], timeout_s: float, what: str) -> list[Any]:
    return gather(calls, timeout_s, what, {}, dict)


LIGHT_THREADS = 1
"""Torch threads of a node without a model (a reward function, an advantage estimate): its
tensors are the rollout's size, a few copies and reductions, and waking a many-thread team
for each costs more than the work. On an H100 machine's CPU worker (16 cores), a GRPO
advantage node's nine small copies took 5.8 ms (``trainer.torch_profile``), 0.64 ms each,
where one thread copies such a tensor in microseconds."""


class StepExecutor:
    def __init__(self, pipeline: PipelineGraph, plan: Plan, hosts: dict[str, Any], node_timeout_s: float,
                 gather: Gather | None = None, threads: dict[tuple[str, str], int] | None = None) -> None:
        self.pipeline = pipeline
        self.plan = plan
        self.hosts = hosts
        self.node_timeout_s = node_timeout_s
        self.gather = gather or _plain_gather
        self._order = pipeline.topological_order()
        self._group_size = {node: _group_size(pipeline, node) for node in self._order}
        self.threads = threads or {}
        """(node, slot) -> torch threads of that call (``flowrl.runtime.threads``); absent: the
        worker's own setting."""

    def run_step(
        self, step: int, prompts: Sequence[Any], kl_coefs: dict[str, float] | None = None, profile_dir: str = ""
    ) -> dict[str, NodeReport]:
        """Run every node of ``step``; ``kl_coefs`` gives advantage nodes their KL penalty;
        ``profile_dir``: every call runs under ``torch.profiler`` and writes there."""
        kl_coefs = kl_coefs or {}
        calls: dict[str, list[Any]] = {}
        for node in self._order:
            slots = self.plan.slots_of(node)
            kl_coef = kl_coefs.get(node, 0.0)
            if len(slots) == 1:
                call = self._call(step, node, prompts, kl_coef, slots[0], profile_dir)
                calls[node] = [self.hosts[slots[0]].run_node(call)]
                continue
            # Split by rows: shard 0 joins the others' parts and serves the whole result; the
            # ranks of a data-parallel update each train on their rows, rank 0 pushes weights.
            peers = tuple(self.hosts[slot] for slot in slots[1:])
            calls[node] = []
            for index, slot in enumerate(slots):
                call = replace(self._call(step, node, prompts, kl_coef, slot, profile_dir), shard=(index, len(slots)),
                               shard_peers=peers if index == 0 else (), shares=self.plan.shares_of(node))
                if index > 0:
                    call = replace(call, weight_peers=())
                calls[node].append(self.hosts[slot].run_node(call))
        reports: dict[str, NodeReport] = {}
        # In dependency order: the first failure met is the one that caused the others.
        for node, futures in calls.items():
            first, *others = self._collect(node, futures)
            reports[node] = replace(first, shards=tuple(others)) if others else first
        return reports

    def _collect(self, node: str, futures: list[Any]) -> list[NodeReport]:
        """The reports of a node's calls. A node split over workers is watched as a whole:
        when one part fails, the others may block (a data-parallel rank in its all-reduce)
        until the collective times out, so the first part to fail is the error reported; a
        part whose worker left the cluster is reported at once (``WorkerLost``)."""
        slots = self.plan.slots_of(node)
        try:
            return list(self.gather(list(zip(slots, futures)), self.node_timeout_s, f"node '{node}'"))
        except NodeTimeout:
            raise self._timeout(node) from None
        except FlowrlError:
            raise  # a lost worker or another fault the driver already classifies
        except Exception as error:
            # A rank whose peer died or stopped answering fails in its collective (the group's
            # timeout), possibly before this node's deadline: the workers of the group (the
            # node's, and those its update broadcasts new weights to) then count as hung, as
            # they would at the deadline, instead of the run failing on that error.
            group = [*slots, *self._weight_peers(node)]
            if len(group) > 1 and peer_failed(error):
                raise NodeTimeout(
                    f"node '{node}' on {', '.join(group)}: a collective of its group failed "
                    f"({type(error).__name__}: {str(error)[:200]}): a rank died or stopped answering",
                    tuple(group), collective=True,
                ) from error
            raise

    def _weight_peers(self, node: str) -> list[str]:
        """The slots an update broadcasts its model's new weights to, inside its call."""
        spec = self.pipeline.spec.nodes[node]
        if not (spec.trains and spec.model is not None):
            return []
        return self.plan.weight_peers(node, spec.model)

    def _timeout(self, node: str) -> NodeTimeout:
        slots = tuple(self.plan.slots_of(node))
        return NodeTimeout(
            f"node '{node}' on {', '.join(slots)} did not finish within "
            f"{self.node_timeout_s:g} s (runtime.node_timeout_s)",
            slots, node,
        )

    def _call(self, step: int, node: str, prompts: Sequence[Any], kl_coef: float, slot: str,
              profile_dir: str = "") -> NodeCall:
        """The call of ``node`` as the host on ``slot`` runs it (inputs held there are local)."""
        spec = self.pipeline.spec.nodes[node]
        inputs = []
        for producer in self.pipeline.producers(node):
            if producer == SOURCE_NODE:
                continue
            producer_slot = self.plan.node_slots[producer]
            host = None if producer_slot == slot else self.hosts[producer_slot]
            role = self.pipeline.spec.nodes[producer].role
            inputs.append(InputRef(name=producer, role=role, key=store_key(step, producer), host=host,
                                   rollout=producer == self.pipeline.rollout_of(node)))
        peers = tuple(self.hosts[s] for s in self._weight_peers(node))
        return NodeCall(
            step=step,
            node=node,
            role=spec.role,
            spec=spec,
            model=spec.model,
            inputs=tuple(inputs),
            prompts=tuple(prompts) if isinstance(spec, GenerateNode) else (),
            group_size=self._group_size[node],
            weight_peers=peers,
            kl_coef=kl_coef,
            lr=self._lr(spec, step),
            threads=LIGHT_THREADS if spec.model is None else self.threads.get((node, slot), 0),
            profile_dir=profile_dir,
        )

    def _lr(self, spec: NodeBase, step: int) -> float | None:
        """An update's rate at ``step`` on its schedule (a function of the step alone)."""
        if not isinstance(spec, UpdateNode):
            return None
        return scheduled_lr(spec.lr, step, spec.lr_decay_steps or self.pipeline.spec.trainer.steps,
                            spec.lr_schedule, spec.lr_warmup_steps, spec.min_lr_ratio)

    def close(self) -> None:
        """Nothing to release: calls live in the hosts."""


def _group_size(pipeline: PipelineGraph, node: str) -> int:
    """Samples per prompt of the generate node upstream of ``node`` (1 if none)."""
    rollout = pipeline.rollout_of(node)
    if rollout is None:
        return 1
    spec = pipeline.spec.nodes[rollout]
    assert isinstance(spec, GenerateNode)
    return int(spec.n)
