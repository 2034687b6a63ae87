"""The ``flowrl`` command.

Every flowrl error becomes one clear message on stderr and exit code 2; an interrupt
exits 130. A traceback is printed only for a bug in flowrl itself.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from flowrl.errors import FlowrlError

FLAG = ""
"""The metavar of an on/off option: the help shows none (typer writes ``<bool>``, which reads
as if the option took a value)."""

app = typer.Typer(
    name="flowrl",
    help="Reinforcement-learning dataflow for language models, placed on Dask workers.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

if TYPE_CHECKING:
    from flowrl.spec.loader import Locate

F = TypeVar("F", bound=Callable[..., Any])


PIPED_WIDTH = 160
"""Columns of the output when it goes to a file or a pipe (rich would assume 80, and wrap a
plan's table into a narrow column)."""


def _console(**options: Any) -> Console:
    """A console that prints text as given: paths, names and messages may hold ``:word:``,
    which rich would otherwise turn into an emoji."""
    stream = sys.stderr if options.get("stderr") else sys.stdout
    if "COLUMNS" not in os.environ and not stream.isatty():
        options.setdefault("width", PIPED_WIDTH)
    return Console(emoji=False, **options)


def _friendly(function: F) -> F:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except FlowrlError as error:
            _console(stderr=True, highlight=False).print(f"[bold red]error:[/] {escape(str(error))}", markup=True, soft_wrap=True)
            raise typer.Exit(code=error.exit_code) from None
        except BrokenPipeError:
            # the reader of the output went away (`flowrl ... | head`) after the work was done
            from flowrl.ui.plain import drop_stream

            drop_stream(sys.stdout)
            return None
        except KeyboardInterrupt as interrupt:
            _console(stderr=True, highlight=False).print(str(interrupt) or "interrupted", markup=False, soft_wrap=True)
            from flowrl.runtime.interrupts import exit_code

            raise typer.Exit(code=getattr(interrupt, "exit_code", None) or exit_code()) from None

    return wrapper  # type: ignore[return-value]


OVERRIDES_HELP = (
    "Set fields of the file: KEY=VALUE with a dotted KEY, such as trainer.steps=50 or "
    "nodes.train.lr=1e-5; VALUE is read as YAML."
)


def _checkpoint_option() -> Any:
    return typer.Option(None, "--checkpoint", metavar="STEP",
                        help="Resume from this checkpoint (step-N or N) instead of the newest; the later checkpoints "
                             "and the final model move to OUTPUT_DIR/rolled_back/.")


def _overrides_argument() -> Any:
    """The ``KEY=VALUE ...`` arguments after the pipeline file (none: an empty list)."""
    return typer.Argument(None, metavar="KEY=VALUE", help=OVERRIDES_HELP, show_default=False)


def _scheduler_option(what: str) -> Any:
    """``--scheduler ADDRESS`` of ``plan`` and ``devices``."""
    return typer.Option(None, "--scheduler", help=f"{what}, as a run that joins it (--scheduler) sees them.")


def flowrl_version() -> str:
    """The installed distribution's version; the package's own when flowrl is not installed
    (run from a source folder)."""
    try:
        return importlib.metadata.version("flowrl")
    except importlib.metadata.PackageNotFoundError:
        from flowrl import __version__

        return __version__


def _print_version(value: bool) -> None:
    if value:
        print(f"flowrl {flowrl_version()}")
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(
        False, "--version", metavar=FLAG, callback=_print_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Reinforcement-learning dataflow for language models, placed on Dask workers."""


@app.command()
@_friendly
def validate(
    pipeline_file: Path = typer.Argument(..., help="Pipeline YAML file."),
    overrides: Optional[list[str]] = _overrides_argument(),
) -> None:
    """Check a pipeline file (with any KEY=VALUE overrides): schema, names, graph, its data and its reward functions. Exit 0 when valid, 2 otherwise."""
    from flowrl.api.checks import check_inputs
    from flowrl.spec.loader import issue_locator, load_pipeline

    graph = load_pipeline(pipeline_file, overrides or [])
    # a run's config.yaml reads its relative paths from the folder of the file the run started from
    from flowrl.api.outputs import pipeline_folder

    base_dir = pipeline_folder(pipeline_file) or pipeline_file.resolve().parent
    check_inputs(graph, base_dir, issue_locator(pipeline_file, overrides or []))
    roles = ", ".join(f"{n} ({graph.spec.nodes[n].role})" for n in graph.topological_order())
    source = f"{pipeline_file} with {' '.join(overrides)}" if overrides else f"{pipeline_file}"
    print(f"{source}: valid pipeline '{graph.name}': {len(graph.spec.nodes)} nodes: {roles}")
    from flowrl.api.loggers import missing_packages

    for problem in missing_packages(graph):  # the file is valid; this machine lacks what it names
        print(f"note: a run started on this machine would be refused: {problem}")
    from flowrl.api.checks import inert_settings
    from flowrl.api.data import not_held_out

    for note in inert_settings(graph):
        print(f"note: {note}")
    if (shared := not_held_out(graph, base_dir)) is not None:
        print(f"note: the evaluation's prompts are those of {shared}")


@app.command()
@_friendly
def run(
    pipeline_file: Path = typer.Argument(..., help="Pipeline YAML file."),
    overrides: Optional[list[str]] = _overrides_argument(),
    steps: Optional[int] = typer.Option(None, min=1, help="Override trainer.steps."),
    output_dir: Optional[str] = typer.Option(None, "--output-dir", "-o", help="Override trainer.output_dir."),
    scheduler: Optional[str] = typer.Option(
        None, help="Join an existing Dask scheduler (tcp://HOST:PORT) instead of starting a local cluster."
    ),
    cpu_slots: Optional[int] = typer.Option(None, min=1, help="Override runtime.cpu_slots (local cluster workers)."),
    seed: Optional[int] = typer.Option(None, help="Override trainer.seed."),
    plain: bool = typer.Option(False, "--plain", metavar=FLAG, help="One log line per step instead of the live view."),
    resume: bool = typer.Option(False, "--resume", metavar=FLAG, help="Continue the run in the output folder from its newest checkpoint."),
    force: bool = typer.Option(False, "--force", metavar=FLAG, help="With --resume: go on although the pipeline changed."),
    checkpoint: Optional[str] = _checkpoint_option(),
    overwrite: bool = typer.Option(
        False, "--overwrite", metavar=FLAG, help="Start over in an output folder that holds an earlier run's checkpoints or final model (deletes them)."
    ),
) -> None:
    """Train a pipeline (with any KEY=VALUE overrides): start (or join) Dask, place the roles, run the steps."""
    if scheduler is None:
        _start_warm_server()
    from flowrl.spec.loader import issue_locator, load_pipeline

    if overwrite and resume:
        raise FlowrlError("--overwrite starts over and --resume continues: give one of them")
    _one_setting(overrides or [], {"steps": ("--steps", "trainer.steps"), "output_dir": ("--output-dir", "trainer.output_dir"),
                                   "scheduler": ("--scheduler", "runtime.scheduler_address"),
                                   "cpu_slots": ("--cpu-slots", "runtime.cpu_slots"), "seed": ("--seed", "trainer.seed")},
                 {"steps": steps, "output_dir": output_dir, "scheduler": scheduler, "cpu_slots": cpu_slots, "seed": seed})
    graph = load_pipeline(pipeline_file, _with_steps(overrides, steps))
    # a run's own config.yaml reads its paths from the folder of the file the run started from
    from flowrl.api.outputs import pipeline_folder

    base_dir = pipeline_folder(pipeline_file) or pipeline_file.resolve().parent
    _train(graph, base_dir, plain, resume, force, overwrite=overwrite,
           locate=issue_locator(pipeline_file, overrides or []),
           steps=steps, output_dir=output_dir, scheduler_address=scheduler, cpu_slots=cpu_slots, seed=seed,
           checkpoint=_checkpoint_step(checkpoint))


def _with_steps(overrides: list[str] | None, steps: int | None) -> list[str]:
    """The overrides, plus ``--steps`` as ``trainer.steps``: the pipeline is validated with the
    run's length (what depends on it, such as ``trainer.torch_profile``, is checked against it)."""
    return [*(overrides or []), *([f"trainer.steps={steps}"] if steps is not None else [])]


@app.command()
@_friendly
def resume(
    output_dir: Path = typer.Argument(..., help="The output folder of the run to continue."),
    overrides: Optional[list[str]] = _overrides_argument(),
    plain: bool = typer.Option(False, "--plain", metavar=FLAG, help="One log line per step instead of the live view."),
    force: bool = typer.Option(False, "--force", metavar=FLAG, help="Go on although the saved pipeline was edited."),
    steps: Optional[int] = typer.Option(
        None, "--steps", min=1, help="Train to this step in all (extends a finished run that kept checkpoints)."
    ),
    checkpoint: Optional[str] = _checkpoint_option(),
) -> None:
    """Continue a run from its output folder (its config.yaml and newest checkpoint), with any
    KEY=VALUE overrides of that config (a changed pipeline needs --force)."""
    _start_warm_server()
    from flowrl.spec.lines import nearest_beside
    from flowrl.spec.loader import issue_locator, load_pipeline

    config = output_dir / "config.yaml"
    if output_dir.is_file():
        raise FlowrlError(f"{output_dir} is a file; give the output folder of a flowrl run (its output_dir)")
    if not output_dir.is_dir():
        near = nearest_beside(output_dir, folders=True, cutoff=0.6)
        hint = f" (did you mean {near}?)" if near is not None else ""
        raise FlowrlError(f"{output_dir}: no such folder{hint}; give the output folder of a flowrl run")
    if not config.is_file():
        raise FlowrlError(f"{output_dir} holds no config.yaml: it is not the output folder of a flowrl run")
    _one_setting(overrides or [], {"steps": ("--steps", "trainer.steps")}, {"steps": steps})
    graph = load_pipeline(config, _with_steps(overrides, steps))
    if any(text.partition("=")[0].strip() == "trainer.output_dir" for text in overrides or []):
        raise FlowrlError(f"a resume goes on in its own folder, {output_dir}: remove the override trainer.output_dir")
    from flowrl.api.outputs import pipeline_folder

    base_dir = pipeline_folder(config) or output_dir.resolve()
    _train(graph, base_dir, plain, True, force, locate=issue_locator(config, overrides or []),
           output_dir=str(output_dir.resolve()), steps=steps, checkpoint=_checkpoint_step(checkpoint))


def _checkpoint_step(text: str | None) -> int | None:
    """The step of ``--checkpoint`` (``step-40`` or ``40``)."""
    if text is None:
        return None
    number = text.strip().removeprefix("step-")
    if not number.isdigit():
        raise FlowrlError(f"--checkpoint {text}: expected a checkpoint's step, such as step-40 or 40")
    return int(number)


def _start_warm_server() -> None:
    """Start the server local workers fork from before anything else: it imports torch and
    transformers (seconds) while this process reads the pipeline and imports its own part.
    A run that joins a scheduler named in the file leaves it unused; it ends with the process."""
    from flowrl.runtime.warm_server import start_warm_server

    start_warm_server()


def _train(graph: Any, base_dir: Path, plain: bool, resume: bool, force: bool, overwrite: bool = False,
           locate: "Locate | None" = None, **overrides: Any) -> None:
    from flowrl.api.checks import raise_early_issues

    runtime = graph.spec.runtime
    pending = None
    raise_early_issues(graph, base_dir, locate)  # the usual mistakes, before any worker starts, at their place
    from flowrl.api.outputs import check_fresh_start, check_not_held, check_resume_flags, check_resume_start

    check_resume_flags(resume, force, overrides.get("checkpoint"))
    if overrides.get("output_dir") == "":
        raise FlowrlError("--output-dir '': trainer.output_dir: must not be empty (it would be the working "
                          "directory); give the run a folder")
    output = Path(overrides.get("output_dir") or graph.spec.trainer.output_dir)
    output = output if output.is_absolute() else Path.cwd() / output
    check_not_held(output)  # a run still going there: say that, not what its files would say
    if resume:
        if overrides.get("checkpoint") is None:  # a chosen checkpoint is checked by the run
            check_resume_start(output, overrides.get("steps") or graph.spec.trainer.steps)
    else:
        check_fresh_start(output, overwrite)
    if not (overrides.get("scheduler_address") or runtime.scheduler_address):
        # The workers start now, and import torch while this process imports the rest of
        # flowrl and reads the data: on a small machine that halves the wait for step 1.
        from flowrl.runtime.cluster import PendingCluster

        pending = PendingCluster(overrides.get("cpu_slots") or runtime.cpu_slots, runtime.dashboard, runtime.pin_cpus)
    try:
        from flowrl.api.run import run as run_pipeline
        from flowrl.spec.loader import placed_within
        from flowrl.ui import make_reporter

        console = _console()
        num_steps = overrides.get("steps") or graph.spec.trainer.steps
        with placed_within(locate), make_reporter(console, plain, graph.name, num_steps) as reporter:
            result = run_pipeline(graph, observer=reporter, base_dir=base_dir, resume=resume, force=force,
                                  local_cluster=pending, overwrite=overwrite, **overrides)
    finally:
        if pending is not None:
            pending.discard()
    if result.already_finished:
        done = result.finished_steps
        console.print(f"the run in {result.output_dir} already finished all {num_steps} steps; nothing to resume"
                      if done <= num_steps else
                      f"the run in {result.output_dir} already finished {done} steps, more than the {num_steps} asked "
                      "for; nothing to resume")
        return
    summary = _reward_summary(result.records)
    if summary:
        console.print(summary)
    console.print(f"outputs: {result.output_dir}")


def _reward_summary(records: list[Any]) -> str:
    """The mean reward of the first and last few steps this process trained; a resumed run
    names its steps (its first ones were trained before)."""
    scored = [(record.step, record.metrics["critic/score/mean"]) for record in records
              if "critic/score/mean" in record.metrics]
    if not scored:
        return ""
    window = max(1, min(10, len(scored) // 2))
    head, tail = scored[:window], scored[-window:]
    first = sum(value for _, value in head) / window
    last = sum(value for _, value in tail) / window
    since = "" if scored[0][0] == 1 else " since the resume"
    from flowrl.ui.format import format_number

    start, end = format_number(first, 3), format_number(last, 3)
    if len(scored) == 1:
        return f"reward mean{since}: step {scored[0][0]} {start}"
    if not since and window > 1:
        return f"reward mean: first {window} steps {start} -> last {window} steps {end}"
    return f"reward mean{since}: {_steps(head)} {start} -> {_steps(tail)} {end}"


def _steps(scored: list[tuple[int, float]]) -> str:
    first, last = scored[0][0], scored[-1][0]
    return f"step {first}" if first == last else f"steps {first}-{last}"


@app.command()
@_friendly
def devices(
    pipeline: Optional[Path] = typer.Option(
        None, "--pipeline", "-p", help="Match this pipeline's device groups against the devices."
    ),
    devices_file: Optional[Path] = typer.Option(
        None, "--devices", help="Inventory file (devices/*.yaml) to use instead of this machine."
    ),
    as_json: bool = typer.Option(False, "--json", metavar=FLAG, help="Print JSON instead of tables."),
    scheduler: Optional[str] = _scheduler_option("Show the workers of this Dask scheduler (tcp://HOST:PORT)"),
) -> None:
    """Show the devices here (or in an inventory file, or behind a Dask scheduler) and how a pipeline's device groups match them."""
    from flowrl.cli.devices import devices_command

    devices_command(pipeline, devices_file, as_json, _console(), scheduler)


@app.command()
@_friendly
def plan(
    pipeline_file: Path = typer.Argument(..., help="Pipeline YAML file."),
    overrides: Optional[list[str]] = _overrides_argument(),
    devices_file: Optional[Path] = typer.Option(
        None, "--devices", help="Inventory file (devices/*.yaml) to plan for instead of this machine."
    ),
    as_json: bool = typer.Option(False, "--json", metavar=FLAG, help="Print the plan as JSON instead of tables."),
    output: Optional[Path] = typer.Option(
        None, "--output", "-o", help="Write the timeline as a picture: .svg or .png."
    ),
    scheduler: Optional[str] = _scheduler_option("Plan for the workers of this Dask scheduler (tcp://HOST:PORT)"),
) -> None:
    """Place a pipeline's nodes on devices and predict one step: placement, memory, critical path, timeline."""
    from flowrl.cli.plan import plan_command

    plan_command(pipeline_file, devices_file, as_json, output, _console(), overrides or [], scheduler)


def _one_setting(overrides: list[str], options: dict[str, tuple[str, str]], given: dict[str, Any]) -> None:
    """An option and a KEY=VALUE override that set the same field: one of them would be
    dropped without a word, so both are refused."""
    keys = {text.partition("=")[0].strip() for text in overrides}
    for name, (flag, key) in options.items():
        if given.get(name) is not None and key in keys:
            raise FlowrlError(f"{flag} and the override {key}=... both set {key}: give one of them")


@app.command()
@_friendly
def simulate(
    pipeline_file: Path = typer.Argument(..., help="Pipeline YAML file."),
    overrides: Optional[list[str]] = _overrides_argument(),
    devices_file: Optional[Path] = typer.Option(
        None, "--devices", help="Inventory file (devices/*.yaml) of the cluster to simulate; default: this machine."
    ),
    steps: int = typer.Option(200, min=1, help="Steps to simulate."),
    scenario: Optional[str] = typer.Option(
        None, help="Scenario name (scenarios/NAME.yaml) or path; default: steady (noise only)."
    ),
    policy: str = typer.Option("both", help="Scheduler policy: static, dynamic, or both side by side."),
    seed: Optional[int] = typer.Option(None, help="Noise seed; default: the scenario's seed."),
    as_json: bool = typer.Option(False, "--json", metavar=FLAG, help="Print the results as JSON instead of tables."),
) -> None:
    """Run scheduler policies on a simulated cluster with noise and device events, and compare them."""
    from flowrl.cli.simulate import simulate_command

    simulate_command(pipeline_file, devices_file, steps, scenario, policy, seed, as_json, _console(), overrides or [])


@app.command()
@_friendly
def report(
    output_dir: Path = typer.Argument(..., help="A run's output folder (trainer.output_dir)."),
    step: Optional[int] = typer.Option(None, "--step", help="Step whose measured timeline is drawn; default: a median one."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Folder for the report; default OUTPUT_DIR/report."),
) -> None:
    """Draw a run: curves, the measured timeline of a step, predicted vs measured, devices; HTML, PNGs, trace."""
    from flowrl.ui.report import build_report

    page = build_report(output_dir, output, step)
    _console().print(f"report: {page}  (Chrome/Perfetto trace: {page.parent / 'trace.json'})")


def main() -> None:
    from flowrl.runtime.interrupts import stop_at_first_signal

    # a second Ctrl-C (or one forwarded by a wrapper beside the terminal's) lets the stop the
    # first one started finish and print where the run stopped, instead of a traceback
    stop_at_first_signal()
    try:
        app()
        code: Any = 0
    except SystemExit as done:
        code = done.code
    _exit(code)


def _exit(code: Any) -> None:
    """Leave without tearing the interpreter down: with torch and transformers imported,
    freeing every module takes about 0.6 s after the command is done. The exit handlers
    still run (Dask's, the fork server's, the trackers'), and the output is flushed first.
    Threads that are not daemons still get the normal exit, which waits for them."""
    import atexit
    import os
    import sys
    import threading

    if any(thread.is_alive() and not thread.daemon and thread is not threading.main_thread()
           for thread in threading.enumerate()):
        sys.exit(code)
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing more to write there
            pass
    os._exit(int(code or 0))


if __name__ == "__main__":
    main()
