"""``run()``: train a pipeline end to end.

    load/validate pipeline -> start or join Dask -> plan placement -> hosts load models
      -> for each step: prompts -> StepExecutor (node calls on hosts) -> metrics, view, files
      -> checkpoints every N steps -> final/ (the trained policy)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from flowrl.api.builder import Pipeline, plain_value
from flowrl.algorithms.kl_control import AdaptiveKLController, FixedKLController
from flowrl.api.loggers import Logger, close_quietly, make_loggers, missing_packages
from flowrl.api.outputs import (RunFolder, check_fresh_start, check_resume_flags, check_resume_start, finished_steps,
                                finite_metrics, pipeline_folder)
from flowrl.api.prometheus import PrometheusMetrics
from flowrl.api.driver import Driver
from flowrl.api.recovery import FoundCheckpoint, RollBack, config_changes, newest_checkpoint, resume_note, roll_back
from flowrl.api.replanning import Replanner
from flowrl.api.result import Observer, RunResult, as_observer, load_run
from flowrl.backends.cache import BUILTIN_PREFIX, built_builtin_dir, cache_root
from flowrl.backends.catalog import builtin_folder
from flowrl.api.data import not_held_out, policy_formatter, read_eval, training_source
from flowrl.api.checks import (call_keywords, check_inputs, eval_reward_issues, inert_settings, model_problems,
                               offered_keywords, reward_issues)
from flowrl.api.evaluation import Evaluator
from flowrl.data import PromptSource
from flowrl.data.formatting import FormatCounts
from flowrl.devices.groups import offload_notes, pipeline_groups
from flowrl.devices.inventory import detect_local
from flowrl.devices.matching import match_groups
from flowrl.devices.report import inventory_lines, match_lines
from flowrl.errors import FlowrlError, RunInterrupted, SpecError, SpecIssue
from flowrl.graph import PipelineGraph, uneven_mini_batches
from flowrl.planner.cost import CPU_OVERHEADS, measure_cpu_rates
from flowrl.planner.costs import EstimatedCosts
from flowrl.planner.micro_batches import resolve_micro_batches, resolved_json
from flowrl.planner.placement import node_group, plan_from_compiled, splittable
from flowrl.records import RunEvent, StepRecord
from flowrl.rewards import REWARD_FUNCTIONS
from flowrl.runtime.interrupts import stopping_for
from flowrl.runtime.cluster import Cluster, PendingCluster, join_for, main_without_a_missing_file
from flowrl.scheduler import make_policy, settings_from_spec
from flowrl.scheduler.calibration import calibrated_prediction
from flowrl.spec.dump import field_changes, resumable_form, to_yaml, written_steps
from flowrl.spec.lines import nearest_beside
from flowrl.spec.loader import issue_locator, load_pipeline
from flowrl.spec.messages import issues_from_validation
from flowrl.spec.schema import AdvantageNode, GenerateNode, RuntimeSpec, ScoreNode

__all__ = ["Observer", "RunResult", "load_run", "run", "validate"]
"""``RunResult`` and ``load_run`` live in ``flowrl.api.result``; the API reaches them here too."""

CALIBRATION_STEPS = 4
"""Steps after the first that learn how far the cost model is off per node, before device
speeds are judged (see ``flowrl.scheduler.calibration``)."""


@dataclass(frozen=True)
class RunOptions:
    """Overrides of the pipeline file given on the command line or to ``run()``."""

    steps: int | None = None
    output_dir: str | None = None
    scheduler_address: str | None = None
    cpu_slots: int | None = None
    seed: int | None = None


def validate(pipeline: PipelineGraph | Pipeline | str | Path, base_dir: str | Path | None = None) -> PipelineGraph:
    """What ``flowrl validate`` checks, from Python: the schema, names and graph (as
    ``build()``), then the model paths, the data (and held-out data) and every reward
    function against the data's columns. Returns the pipeline; raises ``SpecError`` listing
    every problem. ``base_dir``: where relative paths are read from (default: the current
    directory, as for ``run``; for a pipeline given as its file's path, the file's folder)."""
    # a file's problems found after its text (data, models, reward functions) at its lines
    locate = issue_locator(pipeline) if isinstance(pipeline, (str, Path)) else None
    pipeline, base_dir = _pipeline_and_folder(pipeline, base_dir, "validate")
    graph = pipeline.build() if isinstance(pipeline, Pipeline) else pipeline
    check_inputs(graph, Path(base_dir) if base_dir is not None else Path.cwd(), locate)
    return graph


def _pipeline_and_folder(pipeline: object, base_dir: str | Path | None,
                         call: str) -> tuple[PipelineGraph | Pipeline, str | Path | None]:
    """A pipeline given to ``call`` as a builder's, a loaded one, or the path of its file (read
    here; its relative paths are then the file's, as for ``flowrl run FILE``, unless
    ``base_dir`` says otherwise)."""
    if isinstance(pipeline, (str, Path)):
        path = Path(pipeline)
        graph = load_pipeline(path)
        if base_dir is None:  # a run's own config.yaml: the folder of the file that run started from
            base_dir = pipeline_folder(path) or path.resolve().parent
        return graph, base_dir
    if not isinstance(pipeline, (PipelineGraph, Pipeline)):
        raise FlowrlError(f"{call}() takes a pipeline (flowrl.Pipeline, flowrl.load_pipeline(path)) or the path of "
                          f"its file, not a value of type {type(pipeline).__name__}")
    return pipeline, base_dir


def run(
    pipeline: PipelineGraph | Pipeline | str | Path,
    steps: int | None = None,
    output_dir: str | Path | None = None,
    scheduler_address: str | None = None,
    cpu_slots: int | None = None,
    seed: int | None = None,
    observer: Observer | None = None,
    base_dir: str | Path | None = None,
    resume: bool = False,
    force: bool = False,
    local_cluster: PendingCluster | None = None,
    overwrite: bool = False,
    checkpoint: int | None = None,
) -> RunResult:
    """Train ``pipeline``; returns the per-step records. Arguments override the file's values.

    ``resume``: continue the run in the output folder from its newest intact checkpoint (a
    run that finished says so and trains nothing). A pipeline that differs from the one the
    run started with is refused, with the differences, unless ``force``. ``checkpoint``: the
    step of the checkpoint to resume from instead (a roll-back: the later checkpoints and a
    final model are moved into the folder's ``rolled_back/``).

    A fresh run (no ``resume``) refuses an output folder that holds an earlier run's
    checkpoints, which a later resume would take for its own; ``overwrite`` deletes them (and
    the earlier final model) and starts over.

    ``local_cluster``: a local cluster already starting (``flowrl run`` starts it before it
    imports the rest of flowrl); taken when it has the run's slots, closed otherwise. Without
    one, the local cluster starts as soon as the pipeline is checked.

    ``base_dir``: where relative paths (models, data, reward modules) are read from; default:
    the current directory, as for :func:`validate`.
    """
    if _importing_main_in_a_worker():
        # A worker process started by spawn or forkserver runs the main script again; a call
        # of run() at its top level would start a cluster from inside that start-up, and fail
        # deep in multiprocessing. One line here; the run in the main process says what to do.
        raise SystemExit("flowrl.run was called while a worker process imported the main script: put that call "
                         "under `if __name__ == \"__main__\":`")
    try:
        with main_without_a_missing_file():
            pipeline, base_dir = _pipeline_and_folder(pipeline, base_dir, "run")
            observer = as_observer(observer)
            # numbers from Python (numpy's too) as the builder takes them
            steps, cpu_slots, seed = (plain_value(value) for value in (steps, cpu_slots, seed))
            return _run(pipeline, RunOptions(steps, str(output_dir) if output_dir is not None else None,
                                             scheduler_address, cpu_slots, seed),
                        observer, Path(base_dir) if base_dir is not None else Path.cwd(), resume, force,
                        local_cluster, overwrite, checkpoint)
    except FlowrlError as error:
        # The message says what went wrong and what to do; flowrl's own frames would bury it
        # under a dozen lines that mean nothing to the caller (a cause, if any, still shows).
        raise error.with_traceback(None)
    finally:
        if local_cluster is not None:
            local_cluster.discard()  # a run that stopped before taking it


def _kept_before_steps(folder: RunFolder, start: FoundCheckpoint | None, rolling_back: bool = False) -> str:
    """What a run stopped before its first step leaves: the checkpoint it was to resume from,
    untouched, or nothing; a roll-back stopped before its checkpoint was restored moved nothing."""
    if start is not None and rolling_back:
        newest = newest_checkpoint(folder.checkpoints)
        return (f"nothing was rolled back or moved: `flowrl resume {folder.path}` goes on from "
                f"{newest.path.name if newest is not None else 'the start'}, and `--checkpoint {start.path.name}` "
                "rolls back again")
    if start is not None:
        return f"its newest checkpoint is still {start.path.name} (`flowrl resume {folder.path}` goes on from it)"
    return "no checkpoint was written, so a rerun starts from step 1"


def _run_nearby(path: Path) -> str:
    """`` (a folder beside it holds a run: DIR)`` for the folder beside ``path`` that holds a
    run and whose name is closest to its name, or ''."""
    near = nearest_beside(path, folders=True, cutoff=0.6, keep=lambda entry: (entry / "config.yaml").is_file())
    return f" (a folder beside it holds a run: {near}; if -o meant that one, stop this run and resume there)" if near else ""


def _importing_main_in_a_worker() -> bool:
    """Whether this process is a spawned (or forkserver) child still importing the main script
    (multiprocessing marks the process while it prepares it)."""
    import multiprocessing

    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def _run(pipeline: PipelineGraph | Pipeline, options: RunOptions, observer: Observer | None,
         base_dir: Path | None, resume: bool, force: bool, local_cluster: PendingCluster | None,
         overwrite: bool = False, checkpoint: int | None = None) -> RunResult:
    graph = pipeline.build() if isinstance(pipeline, Pipeline) else pipeline
    graph = apply_options(graph, options)
    # The folder is named absolutely in config.yaml, so `flowrl resume DIR` from anywhere
    # resolves to the same pipeline text as `flowrl run FILE --resume` did.
    graph = apply_options(graph, RunOptions(output_dir=str(_resolve(Path(graph.spec.trainer.output_dir)))))
    check_runnable(graph)
    spec = graph.spec
    folder = RunFolder(Path(spec.trainer.output_dir))
    try:
        return _run_in(folder, graph, observer, base_dir, resume, force, local_cluster, overwrite, checkpoint)
    finally:
        folder.release()


def _run_in(folder: RunFolder, graph: PipelineGraph, observer: Observer | None, base_dir: Path | None, resume: bool,
            force: bool, local_cluster: PendingCluster | None, overwrite: bool, checkpoint: int | None) -> RunResult:
    """:func:`_run` in its output folder, which this process holds."""
    spec = graph.spec
    config_text = to_yaml(graph)
    start: FoundCheckpoint | None = None
    earlier_run = folder.read_config() is not None
    forced: list[str] = []
    rolling_back: RollBack | None = None
    planned: int | None = None
    data_before: dict[str, Any] | None = None
    finished: int | None = None
    if resume:
        data_before = folder.read_run_info(strict=True).get("data")
        finished = finished_steps(folder.path)
        before = _started_with(folder)
        earlier_run = earlier_run or before is not None
        forced = _check_unchanged(folder, before, config_text, force)
        planned = written_steps(before) if before is not None else None
        if checkpoint is not None:
            start, rolling_back = roll_back(folder.path, folder.checkpoints, checkpoint)  # moves nothing yet
            if checkpoint >= spec.trainer.steps:
                raise FlowrlError(f"--checkpoint step-{checkpoint} is at or past the {spec.trainer.steps} steps asked "
                                  "for: resume with more steps (--steps; trainer.steps)")
        else:
            if finished is not None and finished >= spec.trainer.steps:
                return RunResult(folder.path, already_finished=True, finished_steps=finished)
            check_resume_start(folder.path, spec.trainer.steps)
            start = newest_checkpoint(folder.checkpoints)
    else:
        check_resume_flags(resume, force, checkpoint)
        _fresh_start(folder, overwrite)
    resumed_data = data_before if start is not None else None  # the data of the steps resumed after
    # the pipeline as the run (re)started, for the next resume to compare with (config.yaml
    # itself may be edited before `flowrl resume`); the data fingerprint of the steps trained
    # so far stays until this run has read and checked its own data: a resume refused for
    # changed data, or stopped before the check, must not let the next one through unchecked.
    # Likewise a pipeline changed with --force is the run's once its checkpoint took it (a
    # model whose saved state does not fit the change refuses the resume, and the next one
    # compares with the pipeline that trained the checkpoint, not with the refused change).
    recorded = before if forced and start is not None else config_text

    def take_config() -> None:
        folder.write_config(config_text)
        folder.write_run_info({**folder.read_run_info(), "config": config_text})

    if recorded == config_text:
        folder.write_config(config_text)
    # a roll-back's run is unfinished once its checkpoint is restored (until then the run stays as it was)
    folder.write_run_info({"base_dir": str(base_dir or Path.cwd()),
                           "finished_steps": finished if rolling_back is not None else None,
                           "config": recorded, "data": resumed_data})
    # a resume with no checkpoint starts over at step 1: the earlier lines stay until the run
    # is about to train (a resume refused before that leaves the run as it was), then go aside
    start_over = start is None and resume and earlier_run
    if start is None and not start_over:
        folder.reset_logs()
    if local_cluster is None and not spec.runtime.scheduler_address:
        # The workers start now and import torch while the trackers, the data and the checks
        # are set up here.
        local_cluster = PendingCluster(spec.runtime.cpu_slots, spec.runtime.dashboard, spec.runtime.pin_cpus)
    restored: list[Callable[[], None]] = [] if recorded == config_text else [take_config]
    if rolling_back is not None and start is not None:
        roll_back_from = start

        def move_aside() -> None:
            assert rolling_back is not None
            moved = rolling_back.move()
            folder.write_run_info({**folder.read_run_info(), "finished_steps": None})
            watcher.event(RunEvent("warning", f"rolled back to {roll_back_from.path.name}: the later checkpoints and the "
                                              f"final model were moved to {moved}", 0))

        restored.append(move_aside)
    watcher = _Watchers(folder, observer, spec.trainer.log_every, on_restored=restored)
    failed = True
    try:
        watcher.start_reporting(graph, config_text, start.step + 1 if start is not None else 0,
                                go_on=rolling_back is None)
        if planned is not None and start is not None and spec.trainer.steps < planned:
            watcher.event(RunEvent("warning", f"trainer.steps is {spec.trainer.steps}, fewer than the {planned} steps the "
                                              f"run was started with: it ends at step {spec.trainer.steps} (resume it "
                                              "with more steps to go on)", 0))
        if forced:
            watcher.event(RunEvent("warning", "resumed with a pipeline that differs from the one the run started with "
                                              f"(--force; {_legend(forced)}): {'; '.join(forced)}", 0, {"changes": forced}))
        if resume and not earlier_run:
            watcher.event(RunEvent("warning", f"resume: {folder.path} held no earlier run, so this one starts at step "
                                              f"1{_run_nearby(folder.path)}", 0))
        result = _run_watched(graph, folder, watcher, base_dir, resume and earlier_run, start, local_cluster,
                              _DataCheck(resumed_data, force), start_over)
        failed = False
        return result
    except BaseException as error:
        # the last step done: of this process, else the one a resume starts after
        done = watcher.last.step if watcher.last is not None else (start.step if start is not None else 0)
        # a stop signal outside the steps (the driver says its own during them): while the run
        # started, or while it wound up after its last step
        if type(error) is KeyboardInterrupt:
            pending = rolling_back is not None and bool(watcher.on_restored)
            where = (f"while the run started, before step {done + 1}; {_kept_before_steps(folder, start, pending)}"
                     if watcher.last is None else
                     f"after step {done}, while the run wound up{resume_note(folder.checkpoints, 'if it did not finish')}")
            error = RunInterrupted(f"stopped {where}", stopping_for() or "SIGINT")
        if not watcher.stopped:  # a check that refused the run, an interrupt, a bug: its folder says why too
            named = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
            why = str(error) if isinstance(error, (FlowrlError, KeyboardInterrupt)) and str(error) else named
            watcher.event(RunEvent("stopped", why, done))
        raise error
    finally:
        watcher.close(failed)
        if local_cluster is not None:
            local_cluster.discard()  # closed here unless the run took it (it closes it then)


@dataclass(frozen=True)
class _DataCheck:
    """The rows the resumed run's steps were drawn from (``PromptSource.fingerprint``; None:
    not a resume from a checkpoint, or not recorded), and whether ``--force`` lets new ones in."""

    before: dict[str, Any] | None = None
    force: bool = False

    def check(self, now: dict[str, Any] | None, folder: RunFolder, watcher: "_Watchers") -> None:
        before = self.before
        if not isinstance(before, dict) or now is None or before == now:
            return
        what = (f"the training data differs from the data the run in {folder.path} was trained on so far "
                f"({before.get('rows')} rows then, {now.get('rows')} now" +
                (", the same number of rows with other contents)" if before.get("rows") == now.get("rows") else ")"))
        if not self.force:
            raise FlowrlError(f"{what}: the resumed steps would draw other batches than an uninterrupted run; "
                              "restore the data, resume with --force (run(..., force=True)) to go on with the new "
                              "data, or give another output_dir to start afresh")
        watcher.event(RunEvent("warning", f"{what}; resumed with it (--force)", 0))


def _run_watched(graph: PipelineGraph, folder: RunFolder, watcher: "_Watchers", base_dir: Path | None,
                 resume: bool, start: FoundCheckpoint | None, pending: PendingCluster | None = None,
                 data_check: _DataCheck = _DataCheck(), start_over: bool = False) -> RunResult:
    spec = graph.spec
    if resume:  # a run to resume was there (a first start with --resume starts quietly)
        for line in start.skipped if start is not None else ():
            watcher.event(RunEvent("warning", f"checkpoint skipped: {line}", 0))
        if start is None:
            watcher.event(RunEvent("warning", f"no intact checkpoint to resume from in {folder.checkpoints}: the run "
                                              "starts over at step 1", 0))

    for path in _builtins_to_fit(graph):
        # minutes without a line would look like a hang
        took = "about 2 minutes on 2 cores; " if path == "builtin:arith-llama" else ""
        watcher.event(RunEvent("status", f"fitting {path} once for this machine ({took}later runs read it from "
                                         f"{cache_root()})", 0))
    formatter = policy_formatter(graph, base_dir or Path.cwd())
    source = training_source(graph, base_dir or Path.cwd(), formatter)
    fingerprint = source.fingerprint()
    data_check.check(fingerprint, folder, watcher)
    folder.write_run_info({**folder.read_run_info(), "data": fingerprint})
    held_out, held_out_counts = read_eval(graph, base_dir or Path.cwd(), formatter)
    preflight(graph, base_dir, offered_keywords(source), call_keywords(held_out) if held_out else None)
    reward_functions = {(node.fn_name or "").strip() for node in spec.nodes.values() if isinstance(node, ScoreNode)}
    # a built-in function named by its module (as to_yaml writes one passed by value) is the same
    reward_functions |= {name for name, fn in REWARD_FUNCTIONS.items()
                         if f"{fn.__module__}:{fn.__qualname__}" in reward_functions}
    watcher.event(RunEvent("data", source.describe(reward_functions), 0))
    if (too_large := source.batch_warning()) is not None:
        watcher.event(RunEvent("warning", too_large, 0))
    for uneven in uneven_mini_batches(spec):
        watcher.event(RunEvent("warning", uneven, 0))
    for inert in inert_settings(graph):
        watcher.event(RunEvent("warning", inert, 0))
    if held_out:
        if (shared := not_held_out(graph, base_dir or Path.cwd())) is not None:
            watcher.event(RunEvent("warning", f"evaluation: {len(held_out)} prompts of {shared}", 0))
        else:
            watcher.event(RunEvent("data", f"evaluation: {len(held_out)} held-out prompts{_formatted(held_out_counts)}", 0))
    address = spec.runtime.scheduler_address
    runtime = spec.runtime
    local = (spec.runtime.cpu_slots, spec.runtime.dashboard, spec.runtime.pin_cpus)
    if address:
        if pending is not None:
            pending.discard()
        ignored = local_only_settings(runtime)
        if ignored:
            watcher.event(RunEvent(
                "warning", f"{', '.join(ignored)} set the local cluster's workers, and this run joins {address}, whose "
                "workers are as they were started (one dask worker per device slot): they are not used", 0))
        cluster = join_for(runtime, address, base_dir or Path.cwd())
    else:
        cluster = (pending.take(*local) if pending is not None else None) or Cluster.start_local(*local)
    try:
        if address:
            cluster.claim(str(folder.path))
        return _train(graph, cluster, folder, source, watcher, base_dir, start, Evaluator(graph, held_out),
                      start_over)
    finally:
        cluster.close()


def _formatted(counts: FormatCounts | None) -> str:
    """What formatting did to held-out prompts too long for data.max_prompt_tokens."""
    if counts is None:
        return ""
    notes = [f"{number} {what}" for number, what in ((counts.num_skipped, "skipped as longer than data.max_prompt_tokens"),
                                                     (counts.num_truncated, "truncated on the left")) if number]
    return f" (of the split read, {', '.join(notes)})" if notes else ""


def _started_with(folder: RunFolder) -> str | None:
    """The pipeline text the run in ``folder`` last (re)started with: as ``run.json`` keeps
    it, else its ``config.yaml`` (None: no run there)."""
    stored = folder.read_run_info().get("config")
    return stored if isinstance(stored, str) else folder.read_config()


def _legend(changes: list[str]) -> str:
    """How to read ``changes``: diff lines, or a line per field."""
    return "- before, + now" if changes and changes[0][:1] in ("-", "+") else "before -> now"


def _real_changes(changes: list[str]) -> list[str]:
    """The diff lines less a ``trainer:`` line pair that differs only in what a resume may
    change (more steps, a moved folder): those are not changes of the job."""
    pair = [line for line in changes if line.startswith(("-trainer:", "+trainer:"))]
    removed = [line[1:] for line in pair if line.startswith("-")] or [""]
    added = [line[1:] for line in pair if line.startswith("+")] or [""]
    # a section written by one run and left out (all defaults) by the other counts as well
    if len(removed) == 1 and len(added) == 1 and _trainer_form(removed[0]) == _trainer_form(added[0]):
        return [line for line in changes if line not in pair]
    return changes


def _trainer_form(line: str) -> Any:
    """A trainer line's resumable form; None for no line and for a section of only steps."""
    return resumable_form(line) or None


def _check_unchanged(folder: RunFolder, before: str | None, config_text: str, force: bool) -> list[str]:
    """The changes of the pipeline since the run started (``before``), a line per field
    (``nodes.train.lr: 0.0005 -> 0.001``; diff lines where the earlier text is not a valid
    pipeline here), when ``force`` lets them through; a FlowrlError showing them otherwise.
    More steps, or the output folder moved, are not changes: a run may be extended or its
    folder copied."""
    if before is None or resumable_form(before) == resumable_form(config_text):
        return []
    changes = field_changes(before, config_text)
    if changes is None:
        changes = _real_changes(config_changes(before, config_text))
    if not changes:  # the same job written otherwise (quoting, order, a default spelled out)
        return []
    if force:
        return changes
    shown = "\n".join(f"  {line}" for line in changes[:20])
    more = f"\n  ... and {len(changes) - 20} more lines" if len(changes) > 20 else ""
    raise FlowrlError(
        f"the pipeline differs from the one the run in {folder.path} started with "
        f"({_legend(changes)}):\n{shown}{more}\n"
        "resume with --force (run(..., force=True)) to go on with the new pipeline, or give another output_dir "
        "to start afresh"
    )


def _train(
    graph: PipelineGraph, cluster: Cluster, folder: RunFolder, source: PromptSource, watcher: "_Watchers",
    base_dir: Path | None, start: FoundCheckpoint | None = None, evaluator: Evaluator | None = None,
    start_over: bool = False,
) -> RunResult:
    """Plan and run the steps on ``cluster``. ``start_over``: a resume with no checkpoint, whose
    earlier lines of steps (step 0's evaluation too) go to NAME.rewound.jsonl as it starts."""
    spec = graph.spec
    slots = [slot.name for slot in cluster.slots]
    where = f"Dask scheduler {spec.runtime.scheduler_address}" if spec.runtime.scheduler_address else "local Dask cluster"
    watcher.event(RunEvent("cluster", f"{where}: {len(slots)} workers ({', '.join(slots)})", 0))
    link = cluster.dashboard_link
    if link is not None and spec.runtime.dashboard:
        base = link.rsplit("/", 1)[0]
        watcher.event(RunEvent("cluster", f"Dask dashboard: {link}; Dask's Prometheus metrics: {base}/metrics", 0))
    inventory = cluster.inventory()
    match = match_groups(pipeline_groups(spec), inventory)
    for line in [*inventory_lines(inventory), *match_lines(match, inventory, offload_notes(spec))]:
        watcher.event(RunEvent("devices", line, 0))
    match.raise_if_unsatisfied()
    # `micro_batch_tokens: auto` becomes a number once, before the first plan: every later
    # plan and every node call of the run uses it
    measured = cluster.cpu_overheads()
    if measured is not None:
        slot, overheads = measured
        watcher.event(RunEvent("devices", f"{slot}: {overheads.per_layer_text()}", 0))
    costs = EstimatedCosts(graph, cpu_rates=measure_cpu_rates(overheads=measured[1] if measured else CPU_OVERHEADS),
                           base_dir=base_dir)
    graph, costs, passes = resolve_micro_batches(graph, inventory, match, costs)
    for item in passes:
        watcher.event(RunEvent("plan", item.line(), 0))
    settings = settings_from_spec(spec.scheduler, calibration_steps=CALIBRATION_STEPS)
    policy = make_policy(spec.scheduler.policy, graph, inventory, settings, costs, base_dir, spec.trainer.steps)
    compiled = policy.plan
    plan = plan_from_compiled(graph, compiled, slots)
    folder.write_plan(0, {**compiled.to_dict(), **resolved_json(passes), "runtime": plan.to_dict()})
    watcher.event(
        RunEvent("plan", f"predicted step {compiled.iteration_s * 1000:.0f} ms; critical path {' -> '.join(compiled.critical_path)}", 0)
    )
    placed = ", ".join(f"{node} -> {'+'.join(plan.slots_of(node))}" for node in plan.node_slots)
    watcher.event(RunEvent("placement", placed, 0))
    replanner = Replanner(graph, policy, plan, slots, folder, watcher.event)
    result = RunResult(folder.path)
    if start_over:
        folder.truncate_logs(-1)
    driver = Driver(graph, cluster, folder, source, watcher, base_dir, replanner, RewardKL(graph),
                    evaluator or Evaluator(graph, []), start, result.records, result.evaluations)
    try:
        driver.run()
    finally:
        driver.close()
        # steps run under torch.profiler are slower than the others: not a measurement of the plan
        timed = [record for record in result.records if record.step not in spec.trainer.torch_profile]
        folder.add_measured_to_plans(timed)
        calibrated = calibrated_prediction(graph, compiled, inventory, costs, folder.governed_by_first_plan(timed))
        if calibrated is not None:
            folder.add_to_plan(0, "calibrated", calibrated)
    result.finished_steps = spec.trainer.steps  # the driver returns only when every step is done
    return result


def _fresh_start(folder: RunFolder, overwrite: bool) -> None:
    check_fresh_start(folder.path, overwrite)
    if overwrite:
        folder.start_over()


def apply_options(graph: PipelineGraph, options: RunOptions) -> PipelineGraph:
    spec = graph.spec
    trainer = spec.trainer
    runtime = spec.runtime
    if options.steps is not None:
        trainer = replace_model(trainer, "trainer", steps=options.steps)
    if options.output_dir is not None:
        trainer = replace_model(trainer, "trainer", output_dir=options.output_dir)
    if options.seed is not None:
        trainer = replace_model(trainer, "trainer", seed=options.seed)
    if options.scheduler_address is not None:
        runtime = replace_model(runtime, "runtime", scheduler_address=options.scheduler_address)
    if options.cpu_slots is not None:
        runtime = replace_model(runtime, "runtime", cpu_slots=options.cpu_slots)
    if trainer is spec.trainer and runtime is spec.runtime:
        return graph
    return PipelineGraph(spec.model_copy(update={"trainer": trainer, "runtime": runtime}))


def replace_model(model: Any, section: str, **changes: Any) -> Any:
    """A validated copy of a frozen pydantic model (the pipeline's ``section``) with some
    fields changed; a value the schema refuses is a user error naming the field."""
    try:
        return type(model).model_validate({**model.model_dump(), **changes})
    except ValidationError as error:
        path, message = issues_from_validation(error, (section,))[0]
        raise FlowrlError(f"{path}: {message}") from None


def check_runnable(graph: PipelineGraph) -> None:
    """Refuse, before any work, a valid pipeline that cannot run here: a group of several devices
    running nodes that do not split, a GPU group without a GPU, a logger or dashboard whose
    package is missing."""
    problems = []
    no_gpu = _no_local_gpu(graph)
    for name, group in graph.spec.devices.items():
        unsplittable = sorted(
            node for node in graph.spec.nodes if node_group(graph, node) == name and not splittable(graph, node)
        )
        if group.effective_count > 1 and unsplittable:
            problems.append(
                f"devices.{name}.count: several devices can run generate, score, reference_logprob, value "
                f"and update nodes, and this group runs {', '.join(unsplittable)}; set count: 1"
            )
        if group.type == "gpu" and no_gpu is not None:
            problems.append(f"devices.{name}.type: this machine has no GPU ({no_gpu}); set type: cpu")
    problems.extend(missing_packages(graph))
    if problems:
        raise FlowrlError("this pipeline is valid but cannot run here:\n" + "\n".join(f"  {p}" for p in problems))


def _no_local_gpu(graph: PipelineGraph) -> str | None:
    """Why a local run has no GPU worker to offer (None: it has one, it joins a cluster
    whose workers may have some, or no group asks for one)."""
    if graph.spec.runtime.scheduler_address or all(group.type != "gpu" for group in graph.spec.devices.values()):
        return None
    inventory = detect_local(num_cpu_slots=0)
    if any(device.kind == "gpu" for device in inventory.devices):
        return None
    return inventory.notes[0] if inventory.notes else "NVML sees none"


def preflight(graph: PipelineGraph, base_dir: Path | None, offered: set[str] | None = None,
              offered_eval: set[str] | None = None) -> None:
    """Catch missing models and reward functions that cannot be called (on the training data's
    keywords ``offered``, and the evaluation's ``offered_eval``), before any worker starts.

    Resolving a builtin model also builds it once, so that workers never race to build
    the same cache directory.
    """
    issues = model_problems(graph, base_dir) + reward_issues(graph, base_dir, offered)
    if offered_eval is not None:
        issues += eval_reward_issues(graph, base_dir, offered_eval, offered)
    if issues:
        raise SpecError([SpecIssue(path, message) for path, message in issues])
    # a folder or hub name, or built already: the driver need not import the builders
    for path in _unbuilt_builtins(graph):
        from flowrl.backends.models import resolve_model_path

        resolve_model_path(path, base_dir)


def _unbuilt_builtins(graph: PipelineGraph) -> list[str]:
    """The pipeline's built-in models (``builtin:NAME``) not in the cache yet (an unknown name
    is left to the checks, which place it)."""
    unbuilt = []
    for path in sorted({model.path for model in graph.spec.models.values() if model.path.startswith(BUILTIN_PREFIX)}):
        try:
            if built_builtin_dir(path[len(BUILTIN_PREFIX):]) is None:
                unbuilt.append(path)
        except FlowrlError:
            continue
    return unbuilt


def _builtins_to_fit(graph: PipelineGraph) -> list[str]:
    """The pipeline's built-in models that are trained when first built (``builtin:arith-llama``,
    the digits reward model) and not in the cache yet."""
    fitted = []
    for path in _unbuilt_builtins(graph):
        if builtin_folder(path[len(BUILTIN_PREFIX):])[1] == "fit.json":
            fitted.append(path)
    return fitted


LOCAL_CLUSTER_SETTINGS = ("cpu_slots", "pin_cpus", "dashboard", "standby_workers")
"""runtime fields that shape the workers of a local cluster (a joined one's are started by
whoever started it)."""


def local_only_settings(runtime: RuntimeSpec) -> list[str]:
    """The local-cluster settings given other values than their defaults."""
    changed = runtime.changed_fields()
    return [f"runtime.{name}" for name in LOCAL_CLUSTER_SETTINGS if name in changed]


def _resolve(path: Path) -> Path:
    # Output folders are relative to where flowrl runs, as users expect of a CLI.
    return path if path.is_absolute() else Path.cwd() / path


class RewardKL:
    """The KL reward-penalty coefficient of each advantage node: fixed, or adapted each step
    towards ``kl_target`` from the measured per-sequence KL (Ziegler et al.)."""

    def __init__(self, graph: PipelineGraph) -> None:
        self.controllers: dict[str, FixedKLController | AdaptiveKLController] = {}
        self.samples_per_step = graph.spec.data.batch_size * max(
            (node.n for node in graph.spec.nodes.values() if isinstance(node, GenerateNode)), default=1
        )
        for name, node in graph.spec.nodes.items():
            if isinstance(node, AdvantageNode) and node.kl_coef > 0:
                self.controllers[name] = (
                    AdaptiveKLController(node.kl_coef, node.kl_target, node.kl_horizon)
                    if node.kl_target is not None
                    else FixedKLController(node.kl_coef)
                )

    def coefs(self) -> dict[str, float]:
        return {name: controller.coef for name, controller in self.controllers.items()}

    def update(self, reports: dict[str, Any]) -> None:
        for name, controller in self.controllers.items():
            measured = reports[name].metrics.get("critic/kl/sequence_mean")
            if measured is not None:
                controller.update(measured, self.samples_per_step)

    def state_dict(self) -> dict[str, Any]:
        return {name: controller.state_dict() for name, controller in self.controllers.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, saved in state.items():
            if name in self.controllers:
                self.controllers[name].load_state_dict(saved)


class _Watchers:
    """Everything a step's record and a run's events go to: the output folder, the terminal
    view, the experiment trackers of ``trainer.loggers`` and ``/metrics``."""

    def __init__(self, folder: RunFolder, observer: Observer | None, log_every: int = 1,
                 on_restored: list[Callable[[], None]] | None = None) -> None:
        self.folder = folder
        self.observer = observer
        self.log_every = log_every
        self.on_restored = list(on_restored or [])
        """Called once, in order, when a resumed run's checkpoint is restored (before its logs
        are cut back to it): what a resume changes in the folder waits until then, so that one
        refused or stopped before leaves the run as it was."""
        self.loggers: list[Logger] = []
        self.prometheus: PrometheusMetrics | None = None
        self.last: StepRecord | None = None
        self.stopped = False
        """A ``stopped`` event (why the run ended) was recorded."""

    def start_reporting(self, graph: PipelineGraph, config_text: str, first_step: int = 0,
                        go_on: bool = True) -> None:
        spec = graph.spec
        if spec.runtime.prometheus_port is not None:
            self.prometheus = PrometheusMetrics(spec.runtime.prometheus_port)
            self.event(RunEvent("status", f"Prometheus metrics: port {self.prometheus.port} of every interface of "
                                          f"this machine (http://127.0.0.1:{self.prometheus.port}/metrics here)", 0))
        self.loggers = make_loggers(spec.trainer.loggers, self.folder.path, spec.name,
                                    spec.model_dump(mode="json"), config_text, first_step, go_on)

    def step(self, record: StepRecord) -> None:
        self.folder.append_metrics(record)
        self.last = record
        self._to_loggers(record)
        if self.prometheus is not None:
            self.prometheus.on_step(record)
        shown = record.step % self.log_every == 0 or record.step == record.num_steps
        if self.observer is not None and shown:
            self.observer.on_step(record)

    def evaluated(self, record: StepRecord) -> None:
        """The evaluation before training (step 0): its line of ``metrics.jsonl`` and the
        trackers' step 0; no step was trained."""
        self.folder.append_metrics(record)
        self._to_loggers(record)

    def rewound(self, last_step: int) -> None:
        """The steps after ``last_step`` run again (a recovery went back to a snapshot or a
        checkpoint): the trackers that can hide what they logged of them do."""
        for logger in self.loggers:
            purge = getattr(logger, "purge_from", None)
            if purge is not None:
                purge(last_step + 1)

    def _to_loggers(self, record: StepRecord) -> None:
        values = finite_metrics(record.metrics)
        for logger in list(self.loggers):
            try:
                logger.step(record.step, values)
            except Exception as error:  # noqa: BLE001 - a tracker's trouble must not stop training
                self.loggers.remove(logger)
                close_quietly(logger, {}, failed=True)
                self.event(RunEvent("warning", f"trainer.loggers: {type(logger).__name__} stopped at step "
                                               f"{record.step} ({type(error).__name__}: {str(error)[:300]}); "
                                               "the run goes on without it", record.step))

    def event(self, event: RunEvent) -> None:
        self.stopped = self.stopped or event.kind == "stopped"
        self.folder.append_event(event)
        if self.prometheus is not None:
            self.prometheus.on_event(event)
        if self.observer is not None:
            self.observer.on_event(event)

    def restored(self) -> None:
        calls, self.on_restored = self.on_restored, []
        for call in calls:
            call()

    def close(self, failed: bool = False) -> None:
        """The run's summary to every logger (the last step's metrics, the steps done and
        the seconds they took; ``failed`` when the run stopped with an error), then stop
        serving ``/metrics``. A tracker that cannot finish is reported, never raised: the
        run's own result or error is what the caller gets."""
        summary: dict[str, float] = {}
        if self.last is not None:
            summary = {**finite_metrics(self.last.metrics), "steps": float(self.last.step),
                       "elapsed_s": self.last.elapsed_s}
        loggers, self.loggers = self.loggers, []
        problems = [problem for logger in loggers if (problem := close_quietly(logger, summary, failed))]
        if self.prometheus is not None:
            try:
                self.prometheus.close()
            finally:
                self.prometheus = None
        for problem in problems:
            self.event(RunEvent("warning", f"trainer.loggers: could not finish {problem}"))
