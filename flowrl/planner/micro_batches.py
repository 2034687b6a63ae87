"""``micro_batch_tokens: auto``: the largest pass that fits.

Before the first plan, every node whose ``micro_batch_tokens`` is ``auto`` gets a number. The
placement is searched with such nodes at one row per pass (the least memory they can need;
``flowrl.planner.work`` reads ``auto`` so); on that placement, node by node in pipeline order,
the most rows per pass for which every device still fits its predicted peak plus the memory
reserve (a binary search: a pass's memory grows with its rows). The node's budget is those
rows times the planned row length (the prompt estimate plus ``max_new_tokens``); on CPU slots,
None when its whole batch (an update: its mini-batch, per rank) fits in one pass. A pass of
real rows holds at most that many padded tokens, so its memory stays within the prediction
when its rows are longer or shorter than planned. The first plan is then searched again with
the numbers (the time model prices a sharded update's gathers per pass and a CPU pass's
shared prompts, so the placement may change; the one found here stays a candidate that fits).

The numbers hold for the whole run: its re-plans, a re-plan after a lost device included,
keep them (they were fitted to the first placement's devices); a resumed run reads ``auto``
from its saved pipeline and fits them again on its own devices.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from flowrl.devices.inventory import Inventory
from flowrl.devices.matching import Match
from flowrl.graph import PipelineGraph
from flowrl.planner.costs import EstimatedCosts
from flowrl.planner.search import SearchOptions, fits, search
from flowrl.planner.simulate import device_memory_gb
from flowrl.planner.work import NodeWork


@dataclass(frozen=True)
class ResolvedPass:
    """What ``auto`` became for one node."""

    node: str
    rows: int
    """Rows of planned length per pass."""
    most_rows: int
    """Rows the node passes at once without a budget (its batch, or mini-batch, per rank)."""
    tokens: int | None
    """The budget: ``rows`` x the planned row length; None (no budget) when the whole batch
    fits in one pass on CPU slots."""
    devices: list[str]

    def line(self) -> str:
        budget = "no budget, all rows in one pass" if self.tokens is None else f"{self.tokens} tokens"
        return (f"{self.node}: micro_batch_tokens auto -> {budget} ({self.rows} of {self.most_rows} rows per pass "
                f"fit on {', '.join(self.devices)})")


def auto_nodes(pipeline: PipelineGraph) -> list[str]:
    return [node for node in pipeline.topological_order()
            if getattr(pipeline.spec.nodes[node], "micro_batch_tokens", None) == "auto"]


def resolve_micro_batches(
    pipeline: PipelineGraph,
    inventory: Inventory,
    match: Match,
    costs: EstimatedCosts,
    options: SearchOptions | None = None,
) -> tuple[PipelineGraph, EstimatedCosts, list[ResolvedPass]]:
    """``pipeline`` with every ``auto`` budget replaced by its number, ``costs`` for it, and
    what each became; ``PlacementError`` when even one row per pass does not fit (as for any
    plan)."""
    nodes = auto_nodes(pipeline)
    if not nodes:
        return pipeline, costs, []
    options = options or SearchOptions()
    placement = search(pipeline, inventory, match, costs, options).best.placement
    kinds = {device.id: device.kind for device in inventory.devices}
    resolved: list[ResolvedPass] = []
    current = costs
    for node in nodes:
        work = current.work(node)
        width = max(1, len(placement[node].devices))
        batch = min(work.num_sequences, work.mini_batch_sequences) if work.work == "train" else work.num_sequences
        most = max(1, -(-batch // width))
        row_tokens = work.prompt_tokens + work.response_tokens

        def fit(rows: int, work: NodeWork = work, node: str = node) -> bool:
            trial = current.with_work(node, replace(work, micro_batch_tokens=rows * row_tokens))
            return fits(device_memory_gb(pipeline, placement, inventory, trial), inventory, options.memory_reserve)[0]

        low, high = 1, most  # one row fits: the search found the placement with one row
        while low < high:
            middle = (low + high + 1) // 2
            if fit(middle):
                low = middle
            else:
                high = middle - 1
        # None (no budget) on CPU slots only, where a pass of the whole batch in rollout order
        # computes each prompt once; elsewhere the budget stays a number, so that a pass never
        # holds more than was fitted (longer rows than planned, a larger share of the rows
        # after the ranks' shares follow their measured speeds)
        on_cpu = all(kinds[device] == "cpu" for device in placement[node].devices)
        tokens = None if low >= most and on_cpu else low * row_tokens
        current = current.with_work(node, replace(work, micro_batch_tokens=tokens))
        resolved.append(ResolvedPass(node, low, most, tokens, list(placement[node].devices)))
    budgets = {item.node: item.tokens for item in resolved}
    specs = {name: spec.model_copy(update={"micro_batch_tokens": budgets[name]}) if name in budgets else spec
             for name, spec in pipeline.spec.nodes.items()}
    resolved_pipeline = PipelineGraph(pipeline.spec.model_copy(update={"nodes": specs}))
    # the estimates of the last trial are those of the resolved pipeline's specs
    return resolved_pipeline, current.for_pipeline(resolved_pipeline), resolved


def resolved_json(passes: list[ResolvedPass]) -> dict[str, Any]:
    """What ``auto`` became, for a plan's JSON (``plan-0.json``, ``flowrl plan --json``)."""
    return {"micro_batch_tokens_auto": [asdict(item) for item in passes]} if passes else {}
