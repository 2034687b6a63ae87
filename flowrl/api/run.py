"""``run()``: train a pipeline end to end.

    load/validate pipeline -> start or join Dask -> plan placement -> hosts load models
      -> for each step: prompts -> StepExecutor (node calls on hosts) -> metrics, view, files
      -> checkpoints every N steps -> final/ (the trained policy)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from flowrl.api.builder import Pipeline
from flowrl.api.metrics import step_metrics
from flowrl.api.outputs import RunFolder
from flowrl.backends.hf import resolve_model_path
from flowrl.data import PromptSource
from flowrl.devices.groups import offload_notes, pipeline_groups
from flowrl.devices.matching import match_groups
from flowrl.devices.report import inventory_lines, match_lines
from flowrl.errors import FlowrlError
from flowrl.graph import PipelineGraph
from flowrl.planner.compiled import compile_plan
from flowrl.planner.cost import measure_cpu_rates
from flowrl.planner.placement import plan_from_compiled
from flowrl.records import RunEvent, StepRecord
from flowrl.rewards import resolve_reward
from flowrl.runtime.cluster import Cluster
from flowrl.runtime.session import Session
from flowrl.spec.dump import to_yaml

SUPPORTED_ESTIMATORS = ("grpo",)
SUPPORTED_ROLES = ("generate", "score", "reference_logprob", "advantage", "update")


class Observer(Protocol):
    def on_step(self, record: StepRecord) -> None: ...
    def on_event(self, event: RunEvent) -> None: ...


@dataclass
class RunResult:
    output_dir: Path
    records: list[StepRecord] = field(default_factory=list)

    def metric(self, name: str) -> list[float]:
        return [r.metrics[name] for r in self.records if name in r.metrics]


@dataclass(frozen=True)
class RunOptions:
    """Overrides of the pipeline file given on the command line or to ``run()``."""

    steps: int | None = None
    output_dir: str | None = None
    scheduler_address: str | None = None
    cpu_slots: int | None = None
    seed: int | None = None


def run(
    pipeline: PipelineGraph | Pipeline,
    steps: int | None = None,
    output_dir: str | Path | None = None,
    scheduler_address: str | None = None,
    cpu_slots: int | None = None,
    seed: int | None = None,
    observer: Observer | None = None,
    base_dir: Path | None = None,
) -> RunResult:
    """Train ``pipeline``; returns the per-step records. Arguments override the file's values."""
    graph = pipeline.build() if isinstance(pipeline, Pipeline) else pipeline
    options = RunOptions(steps, str(output_dir) if output_dir is not None else None, scheduler_address, cpu_slots, seed)
    graph = apply_options(graph, options)
    check_runnable(graph)
    spec = graph.spec
    folder = RunFolder(_resolve(Path(spec.trainer.output_dir), base_dir))
    folder.write_config(to_yaml(graph))
    folder.reset_logs()
    watcher = _Watchers(folder, observer)

    source = PromptSource(
        spec.data.source,
        batch_size=spec.data.batch_size,
        seed=spec.trainer.seed,
        base_dir=base_dir or Path.cwd(),
        shuffle=spec.data.shuffle,
        prompt_field=spec.data.prompt_field,
        answer_field=spec.data.answer_field,
    )
    preflight(graph, base_dir)
    address = spec.runtime.scheduler_address
    cluster = Cluster.join(address) if address else Cluster.start_local(spec.runtime.cpu_slots, spec.runtime.dashboard)
    try:
        return _train(graph, cluster, folder, source, watcher, base_dir)
    finally:
        cluster.close()


def _train(
    graph: PipelineGraph, cluster: Cluster, folder: RunFolder, source: PromptSource, watcher: "_Watchers", base_dir: Path | None
) -> RunResult:
    spec = graph.spec
    slots = [slot.name for slot in cluster.slots]
    where = f"Dask scheduler {spec.runtime.scheduler_address}" if spec.runtime.scheduler_address else "local Dask cluster"
    watcher.event(RunEvent("cluster", f"{where}: {len(slots)} workers ({', '.join(slots)})", 0))
    inventory = cluster.inventory()
    match = match_groups(pipeline_groups(spec), inventory)
    for line in [*inventory_lines(inventory), *match_lines(match, inventory, offload_notes(spec))]:
        watcher.event(RunEvent("devices", line, 0))
    match.raise_if_unsatisfied()
    compiled = compile_plan(graph, inventory, match, base_dir=base_dir, cpu_rates=measure_cpu_rates())
    plan = plan_from_compiled(graph, compiled, slots)
    folder.write_plan(0, {**compiled.to_dict(), "runtime": plan.to_dict()})
    watcher.event(
        RunEvent("plan", f"predicted step {compiled.iteration_s * 1000:.0f} ms; critical path {' -> '.join(compiled.critical_path)}", 0)
    )
    placed = ", ".join(f"{node} -> {slot}" for node, slot in plan.node_slots.items())
    watcher.event(RunEvent("placement", placed, 0))
    session = Session(cluster, graph, plan, base_dir)
    try:
        for info in session.load_models():
            watcher.event(
                RunEvent("model", f"{info['model']} on {info['device']}: {info['num_parameters']:,} parameters", 0)
            )
        result = RunResult(folder.path)
        started = time.perf_counter()
        num_steps = spec.trainer.steps
        for step in range(1, num_steps + 1):
            step_started = time.perf_counter()
            reports = session.run_step(step, source.next_batch(step - 1))
            step_s = time.perf_counter() - step_started
            devices = session.sample_devices()
            metrics, nodes = step_metrics(graph, reports, step_s, num_devices=len(session.hosts))
            record = StepRecord(step, num_steps, metrics, nodes, devices, time.perf_counter() - started)
            result.records.append(record)
            watcher.step(record)
            every = spec.trainer.checkpoint_every
            if every and step % every == 0 and step < num_steps:
                _checkpoint(session, folder, step, spec.trainer.keep_checkpoints, watcher)
        _save_final(session, folder, watcher, num_steps)
        return result
    finally:
        session.close()


def _checkpoint(session: Session, folder: RunFolder, step: int, keep: int, watcher: "_Watchers") -> None:
    staging = folder.checkpoint_staging(step)
    session.save_models(staging, with_state=True)
    final = folder.commit_checkpoint(staging, step, {"step": step}, keep)
    watcher.event(RunEvent("checkpoint", f"saved {final}", step))


def _save_final(session: Session, folder: RunFolder, watcher: "_Watchers", step: int) -> None:
    staging = folder.path / ".final.tmp"
    if staging.exists():
        import shutil

        shutil.rmtree(staging)
    session.save_models(staging, with_state=False)
    trained = sorted(session.trained_models())
    final = folder.path / "final"
    if final.exists():
        import shutil

        shutil.rmtree(final)
    if len(trained) == 1:
        # One trained policy: final/ is that model's directory, ready for from_pretrained.
        (staging / trained[0]).rename(final)
        staging.rmdir()
    else:
        staging.rename(final)
    watcher.event(RunEvent("final", f"saved {final}", step))


def apply_options(graph: PipelineGraph, options: RunOptions) -> PipelineGraph:
    spec = graph.spec
    trainer = spec.trainer
    runtime = spec.runtime
    if options.steps is not None:
        trainer = replace_model(trainer, steps=options.steps)
    if options.output_dir is not None:
        trainer = replace_model(trainer, output_dir=options.output_dir)
    if options.seed is not None:
        trainer = replace_model(trainer, seed=options.seed)
    if options.scheduler_address is not None:
        runtime = replace_model(runtime, scheduler_address=options.scheduler_address)
    if options.cpu_slots is not None:
        runtime = replace_model(runtime, cpu_slots=options.cpu_slots)
    if trainer is spec.trainer and runtime is spec.runtime:
        return graph
    return PipelineGraph(spec.model_copy(update={"trainer": trainer, "runtime": runtime}))


def replace_model(model: Any, **changes: Any) -> Any:
    """A validated copy of a frozen pydantic model with some fields changed."""
    return type(model).model_validate({**model.model_dump(), **changes})


def check_runnable(graph: PipelineGraph) -> None:
    """Refuse, before any work, what this version validates but cannot run."""
    problems = []
    for name, node in graph.spec.nodes.items():
        if node.role not in SUPPORTED_ROLES:
            problems.append(f"nodes.{name}.role: '{node.role}' nodes cannot run yet (runnable: {', '.join(SUPPORTED_ROLES)})")
        if node.role == "advantage" and node.estimator not in SUPPORTED_ESTIMATORS:
            problems.append(f"nodes.{name}.estimator: '{node.estimator}' cannot run yet; use 'grpo'")
        if node.role == "score" and getattr(node, "model", None) is not None:
            problems.append(f"nodes.{name}.model: model-based scores cannot run yet; use fn:")
        if node.role == "update" and node.model is not None and graph.spec.models[node.model].kind != "policy":
            problems.append(f"nodes.{name}: only policy models can be updated in this version")
    if graph.spec.scheduler.policy != "static":
        problems.append("scheduler.policy: 'dynamic' cannot run yet; use 'static'")
    if problems:
        raise FlowrlError("this pipeline is valid but cannot run in this version:\n" + "\n".join(f"  {p}" for p in problems))


def preflight(graph: PipelineGraph, base_dir: Path | None) -> None:
    """Catch missing models and reward functions here, before any worker starts.

    Resolving a builtin model also builds it once, so that workers never race to build
    the same cache directory.
    """
    for model in graph.spec.models.values():
        resolve_model_path(model.path, base_dir)
    for node in graph.spec.nodes.values():
        if node.role == "score" and node.fn is not None:
            resolve_reward(node.fn, base_dir)


def _resolve(path: Path, base_dir: Path | None) -> Path:
    # Output folders are relative to where flowrl runs, as users expect of a CLI.
    return path if path.is_absolute() else Path.cwd() / path


class _Watchers:
    def __init__(self, folder: RunFolder, observer: Observer | None) -> None:
        self.folder = folder
        self.observer = observer

    def step(self, record: StepRecord) -> None:
        self.folder.append_metrics(record)
        if self.observer is not None:
            self.observer.on_step(record)

    def event(self, event: RunEvent) -> None:
        self.folder.append_event(event)
        if self.observer is not None:
            self.observer.on_event(event)
