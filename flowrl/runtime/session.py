"""The live side of a run: hosts on workers, their models, and one call per node.

A ``Session`` executes a ``Plan``; it does not decide one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from flowrl.graph import PipelineGraph
from flowrl.planner.placement import Plan
from flowrl.records import DeviceSample
from flowrl.runtime.calls import NodeReport
from flowrl.runtime.cluster import Cluster
from flowrl.runtime.executor import StepExecutor
from flowrl.runtime.host import RoleHost


class Session:
    def __init__(self, cluster: Cluster, pipeline: PipelineGraph, plan: Plan, base_dir: Path | None) -> None:
        self.cluster = cluster
        self.pipeline = pipeline
        self.plan = plan
        runtime = pipeline.spec.runtime
        slots_in_use = sorted(set(plan.node_slots.values()))
        by_name = {slot.name: slot for slot in cluster.slots}
        # Nodes of one step mostly run one after another (rollout -> ref -> update), so each
        # worker may use every core of its host; measured on 2 cores: 0.105 s/step with one
        # thread per worker, 0.085 s with two.
        threads = runtime.torch_threads or max(1, os.cpu_count() or 1)
        seed = pipeline.spec.trainer.seed
        futures = {
            name: cluster.client.submit(
                RoleHost,
                name,
                "cpu",
                threads,
                seed,
                str(base_dir) if base_dir else None,
                actor=True,
                workers=[by_name[name].worker],
                allow_other_workers=False,
                pure=False,
            )
            for name in slots_in_use
        }
        self.hosts: dict[str, Any] = {name: future.result() for name, future in futures.items()}
        self.executor = StepExecutor(pipeline, plan, self.hosts, runtime.node_timeout_s)

    def load_models(self) -> list[dict[str, Any]]:
        """Load every model on every slot that holds it, all slots at once."""
        seed = self.pipeline.spec.trainer.seed
        calls = []
        for model, slots in self.plan.model_slots.items():
            spec = self.pipeline.spec.models[model]
            for slot in slots:
                calls.append(self.hosts[slot].load_model(model, spec, seed))
        return [call.result() for call in calls]

    def run_step(
        self, step: int, prompts: Sequence[Any], kl_coefs: dict[str, float] | None = None
    ) -> dict[str, NodeReport]:
        return self.executor.run_step(step, prompts, kl_coefs)

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
        """Each trained model is written by the worker that holds it, all at once."""
        by_slot: dict[str, list[str]] = {}
        for model, slot in self.trained_models().items():
            by_slot.setdefault(slot, []).append(model)
        # Actor calls run concurrently on their workers; wait for all of them.
        calls = [self.hosts[slot].save_models(str(directory), models, with_state) for slot, models in by_slot.items()]
        for call in calls:
            call.result(timeout=600)

    def close(self) -> None:
        self.executor.close()
