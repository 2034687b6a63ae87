"""Torch threads for each node call on an unpinned CPU worker.

Workers of one machine that are not pinned share its cores. Most nodes of a step run one after
another (rollout -> ref -> update), and each should then use every core; but nodes on
different workers that the graph lets run at the same time (a PPO actor's and critic's
updates, a reference forward beside a value forward, the parts of a split node) would put
2 x cores threads on the cores. OpenMP threads that wait for work spin for a while before they
sleep, so an oversubscribed machine loses most of its time to spinning (ppo_tiny's updates
took 166-176 ms instead of 57-64 on 2 cores). Each call therefore gets the cores divided by
the workers that may compute beside it: never more threads than cores, and every core to a
node that runs alone. OpenMP's wait is therefore left at its default: a thread that sleeps at
once costs every parallel region a wake-up (the default pipeline's update took 47-50 ms against
34-39 ms spinning).

A node "may compute beside" another when neither depends on the other and both do model work;
a score function or an advantage estimate is light and counted as nothing. Light nodes are not
listed: they run on one thread wherever they are (``StepExecutor``, ``LIGHT_THREADS``).
"""

from __future__ import annotations

from flowrl.graph import PipelineGraph
from flowrl.planner.placement import Plan
from flowrl.planner.sharing import company, divided_threads, heavy, related_nodes


def call_threads(pipeline: PipelineGraph, plan: Plan, cores: int, shared: set[str]) -> dict[tuple[str, str], int]:
    """(node, slot) -> torch threads for that call of a node with a model, for the slots in
    ``shared`` (unpinned CPU workers of one machine with ``cores`` cores). Calls on other
    slots, and light nodes' calls, are not listed. The planner predicts the same division
    (``flowrl.planner.sharing``)."""
    related = related_nodes(pipeline)
    node_slots = {node: tuple(plan.slots_of(node)) for node in plan.node_slots}
    threads: dict[tuple[str, str], int] = {}
    for node in plan.node_slots:
        if not heavy(pipeline, node):
            continue
        for slot in plan.slots_of(node):
            if slot not in shared:
                continue
            beside = company(pipeline, node_slots, node, slot, related)
            threads[node, slot] = divided_threads(cores, len(beside & shared))
    return threads
