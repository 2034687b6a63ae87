"""Runs one step of the pipeline on the hosts, in dependency order.

The driver keeps one thread per node of the step. A node's thread waits until every
producer's call has returned, then sends its own call to its host and waits for the
report. Batches never come back here: the consumer's host fetches them from the
producer's host. Independent nodes on different hosts therefore run at the same time.

    node thread: wait(producers' futures) -> host.run_node(call) -> NodeReport
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

from flowrl.errors import ClusterError
from flowrl.graph import PipelineGraph
from flowrl.planner.placement import Plan
from flowrl.runtime.calls import InputRef, NodeCall, NodeReport, store_key

PROMPTS = "prompts"


class StepExecutor:
    def __init__(self, pipeline: PipelineGraph, plan: Plan, hosts: dict[str, Any], node_timeout_s: float) -> None:
        self.pipeline = pipeline
        self.plan = plan
        self.hosts = hosts
        self.node_timeout_s = node_timeout_s
        self._order = pipeline.topological_order()
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self._order)), thread_name_prefix="flowrl-node")
        self._group_size = {node: _group_size(pipeline, node) for node in self._order}

    def run_step(self, step: int, prompts: Sequence[Any]) -> dict[str, NodeReport]:
        futures: dict[str, Future[NodeReport]] = {}
        for node in self._order:
            producers = [p for p in self.pipeline.producers(node) if p != PROMPTS]
            futures[node] = self._pool.submit(self._run_node, step, node, [futures[p] for p in producers], prompts)
        return {node: future.result() for node, future in futures.items()}

    def _run_node(self, step: int, node: str, waits: list[Future[NodeReport]], prompts: Sequence[Any]) -> NodeReport:
        for future in waits:
            future.result()
        call = self._call(step, node, prompts)
        slot = self.plan.node_slots[node]
        try:
            return self.hosts[slot].run_node(call).result(timeout=self.node_timeout_s)
        except TimeoutError as error:
            raise ClusterError(
                f"node '{node}' on {slot} did not finish within {self.node_timeout_s:.0f} s "
                "(runtime.node_timeout_s)"
            ) from error

    def _call(self, step: int, node: str, prompts: Sequence[Any]) -> NodeCall:
        spec = self.pipeline.spec.nodes[node]
        slot = self.plan.node_slots[node]
        inputs = []
        for producer in self.pipeline.producers(node):
            if producer == PROMPTS:
                continue
            producer_slot = self.plan.node_slots[producer]
            host = None if producer_slot == slot else self.hosts[producer_slot]
            role = self.pipeline.spec.nodes[producer].role
            inputs.append(InputRef(name=producer, role=role, key=store_key(step, producer), host=host))
        peers: tuple[Any, ...] = ()
        if spec.role == "update" and spec.model is not None:
            peers = tuple(self.hosts[s] for s in self.plan.weight_peers(node, spec.model))
        return NodeCall(
            step=step,
            node=node,
            role=spec.role,
            spec=spec,
            model=spec.model,
            inputs=tuple(inputs),
            prompts=tuple(prompts) if spec.role == "generate" else (),
            group_size=self._group_size[node],
            weight_peers=peers,
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _group_size(pipeline: PipelineGraph, node: str) -> int:
    """Samples per prompt of the generate node upstream of ``node`` (1 if none)."""
    seen: set[str] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current in seen or current == PROMPTS:
            continue
        seen.add(current)
        spec = pipeline.spec.nodes[current]
        if spec.role == "generate":
            return int(spec.n)
        stack.extend(pipeline.producers(current))
    return 1
