"""Between two steps: measure, let the scheduler decide, carry out what it accepts.

    after step k:   node timings + device samples -> profiler (EWMA, status line)
                                                  -> policy.observe
    before step k:  policy.decide -> accepted: runtime plan -> session.apply_plan
                                   (roles move worker to worker) -> measured move cost
                                   -> policy.observe_move; every decision is an event

The runtime executes plans and the policy decides them; this module only connects the two
and tells the user what happened and why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from flowrl.api.metrics import status_labels
from flowrl.api.outputs import RunFolder
from flowrl.graph import PipelineGraph
from flowrl.errors import PlacementError
from flowrl.planner.placement import Plan, plan_from_compiled, without_slots
from flowrl.profiler import NodeProfile, alpha_for_window
from flowrl.records import RunEvent, StepRecord
from flowrl.runtime.session import Session
from flowrl.scheduler import Decision, SchedulerPolicy
from flowrl.scheduler.events import DeviceEvent, DeviceLost, DeviceReplaced
from flowrl.scheduler.shares import rebalanced


class Replanner:
    def __init__(
        self,
        graph: PipelineGraph,
        policy: SchedulerPolicy,
        plan: Plan,
        slots: list[str],
        folder: RunFolder,
        emit: Callable[[RunEvent], None],
    ) -> None:
        self.graph = graph
        self.policy = policy
        self.plan = plan
        """The plan the runtime runs (or is to run when a session is built on it next)."""
        self.session: Session | None = None
        self.folder = folder
        self.emit = emit
        self.slots = slots
        self.profile = NodeProfile(alpha_for_window(graph.spec.profiler.ewma_window))
        self.labels = status_labels(graph)
        self._events: list[DeviceReplaced] = []
        """Device events to tell the policy before the next step (``note``)."""

    def note(self, events: list[DeviceReplaced]) -> None:
        """Events the policy hears before the next step (or the next shrink): a recovery tells
        of slots that a worker on another machine took while no step ran. Of a slot taken
        twice before then, only the last taker counts."""
        for event in events:
            self._events = [e for e in self._events if e.device.id != event.device.id] + [event]

    def _take_events(self, gone: set[str] | None = None) -> list[DeviceEvent]:
        events: list[DeviceEvent] = [e for e in self._events if e.device.id not in (gone or set())]
        self._events = []
        return events

    def before_step(self, step: int) -> None:
        for decision in self.policy.decide(step, self._take_events()):
            self._carry_out(step, decision)

    def after_step(self, record: StepRecord, step_s: float) -> None:
        # A step run under torch.profiler (trainer.torch_profile) is slower than the others:
        # its times would mislead the estimates and the policy.
        if record.step not in self.graph.spec.trainer.torch_profile:
            self.profile.observe(record.nodes)
            self.policy.observe(record.step, record.nodes, record.devices, step_s)
        every = self.graph.spec.scheduler.every_steps
        if record.step % every == 0 or record.step == record.num_steps:
            self.folder.append_smoothed(record.step, list(self.profile.summary().values()))
            self.emit(RunEvent("status", self.profile.status_line(record.step, self.labels), record.step))
            if record.step < record.num_steps:
                self._balance(record.step)

    def shrink(self, step: int, gone: list[str], survivors: list[str]) -> Plan:
        """The plan without the slots in ``gone`` (their workers did not come back): the
        policy re-plans when it can (it then knows the devices are gone), else the nodes of a
        lost slot move to the survivors (``without_slots``: with their model's other nodes, on
        the survivor that runs the fewest). The next session runs it."""
        events = [*self._take_events(set(gone)), *(DeviceLost(slot) for slot in gone)]
        for decision in self.policy.decide(step, events):
            if decision.accepted and decision.plan is not None:
                try:
                    self.plan = plan_from_compiled(self.graph, decision.plan, survivors)
                    return self.plan
                except PlacementError:
                    break
        self.plan = without_slots(self.graph, self.plan, set(gone), survivors, step)
        return self.plan

    def state_dict(self) -> dict[str, Any]:
        """The policy's learned state and the learned row shares of split nodes."""
        return {"policy": self.policy.state_dict(), "shares": dict(self.plan.node_shares)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.policy.load_state_dict(state.get("policy", {}))
        shares = {
            node: [float(x) for x in values]
            for node, values in state.get("shares", {}).items()
            if node in self.plan.node_shards and len(values) == len(self.plan.slots_of(node))
        }
        if shares:
            self.plan = replace(self.plan, node_shares={**self.plan.node_shares, **shares})
            if self.session is not None:
                self.session.set_shares(shares)

    def _balance(self, step: int) -> None:
        """Split nodes: rows per part proportional to the part's measured speed."""
        plan = self.plan
        summary = self.profile.summary()
        changed: dict[str, list[float]] = {}
        for node, slots in plan.node_shards.items():
            times = [summary.get(f"{node}@{slot}") for slot in slots]
            if any(item is None for item in times):
                continue
            compute = [item.compute_s for item in times if item is not None]
            shares = rebalanced(plan.shares_of(node), compute)
            if shares is None:
                continue
            changed[node] = list(shares)
            parts = ", ".join(f"{slot} {share:.0%}" for slot, share in zip(slots, shares))
            measured = " vs ".join(f"{seconds * 1e3:.0f} ms" for seconds in compute)
            self.emit(RunEvent("shares", f"{node}: rows {parts} (measured {measured})", step, {"node": node, "shares": list(shares)}))
        if changed:
            self.plan = replace(plan, node_shares={**plan.node_shares, **changed})
            if self.session is not None:
                self.session.set_shares(changed)
            for node in changed:  # times measured under the old shares say little now
                self.profile.forget(node)

    def _carry_out(self, step: int, decision: Decision) -> None:
        data = decision.to_dict()
        triggers = ", ".join(decision.triggers)
        if not decision.accepted or decision.plan is None:
            self.emit(RunEvent("replan", f"stays ({triggers}): {decision.reason}", step, data))
            return
        # (the policy's search counts a placement whose weight pushes wait for each other as
        # infeasible, so it never accepts one)
        plan = plan_from_compiled(self.graph, decision.plan, self.slots)
        for move in decision.moves:
            self.emit(
                RunEvent(
                    "move",
                    f"moving {move.subject}: {move.route} "
                    f"({move.why}, predicted gain {decision.gain_share:.0%}/step, move cost {move.cost_s:.2f} s)",
                    step,
                )
            )
        old = self.plan
        # learned row shares stay with split nodes whose workers did not change
        kept = {
            node: shares
            for node, shares in old.node_shares.items()
            if node in plan.node_shards and plan.slots_of(node) == old.slots_of(node)
        }
        # The policy now plans from the new placement: a move cut short by a fault is
        # finished by the session built next, on this plan.
        self.plan = replace(plan, node_shares=kept)
        if self.session is None:
            raise RuntimeError("re-plan without a session")
        result = self.session.apply_plan(self.plan)
        self.policy.observe_move(decision.move_cost_s, result.seconds)
        self.folder.write_plan(step, {**decision.plan.to_dict(), "runtime": plan.to_dict(), "decision": data})
        data = {**data, "measured_move_s": result.seconds, "moved_bytes": result.num_bytes}
        self.emit(
            RunEvent(
                "replan",
                f"re-planned before step {step} ({triggers}): {decision.reason}; moved in {result.seconds:.2f} s "
                f"(predicted {decision.move_cost_s:.2f} s, {result.num_bytes / 1e6:.1f} MB worker to worker); "
                f"predicted step {decision.predicted_before_s * 1e3:.0f} -> {decision.predicted_after_s * 1e3:.0f} ms",
                step,
                data,
            )
        )
