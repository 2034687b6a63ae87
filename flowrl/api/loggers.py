"""Experiment trackers a run reports to, besides ``metrics.jsonl`` (always written).

``trainer.loggers`` names them: ``tensorboard`` (``torch.utils.tensorboard``, event files in
``OUTPUT_DIR/tensorboard``), ``wandb`` (a W&B run in ``OUTPUT_DIR/wandb``; offline unless an
API key or ``WANDB_MODE`` says otherwise, so it works without a network) and ``mlflow`` (an
MLflow run in ``MLFLOW_TRACKING_URI``, by default the file store ``OUTPUT_DIR/mlruns``). Each
gets the same thing: the resolved pipeline as its config, every step's metrics at that step,
and the run's summary at the end. Their packages are optional (``pip install
'flowrl[tensorboard]'`` and so on): :func:`logger_problems` names a missing one before the
run starts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Any, Protocol

from flowrl.errors import FlowrlError
from flowrl.graph import PipelineGraph


PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
            "mlflow": ("mlflow", "mlflow")}
"""Logger name -> (module it needs, flowrl extra that installs it)."""


class Logger(Protocol):
    def step(self, step: int, metrics: dict[str, float]) -> None:
        """Record one step's metrics."""

    def close(self, summary: dict[str, float], failed: bool = False) -> None:
        """Record the run's summary and finish (``failed``: the run stopped with an error)."""


def missing_package(module: str, place: str, who: str, extra: str, instead: str) -> str | None:
    """What to say, before anything starts, when ``module`` (what ``who`` needs) is not
    installed: the field, the flowrl extra that installs it, and the other way out."""
    if importlib.util.find_spec(module) is not None:
        return None
    return (f"{place}: {who} needs the {module} package, which is not installed; "
            f"install it (pip install 'flowrl[{extra}]') or {instead}")


def logger_problems(names: tuple[str, ...]) -> list[str]:
    """What stops a logger from running (its package is not installed), said before anything
    starts."""
    problems = []
    for name in names:
        module, extra = PACKAGES.get(name, (None, None))
        if module is not None and extra is not None:
            problem = missing_package(module, "trainer.loggers", f"'{name}'", extra,
                                      f"remove '{name}' from trainer.loggers")
            if problem is not None:
                problems.append(problem)
    return problems


def missing_packages(graph: PipelineGraph) -> list[str]:
    """The loggers and the dashboard the pipeline asks for whose packages this machine lacks
    (a run started here would be refused), one line each."""
    problems = logger_problems(graph.spec.trainer.loggers)
    runtime = graph.spec.runtime
    if runtime.dashboard and runtime.scheduler_address is None:
        problem = missing_package("bokeh", "runtime.dashboard", "Dask's dashboard", "dashboard", "set dashboard: false")
        if problem is not None:
            problems.append(problem)
    return problems


def make_loggers(names: tuple[str, ...], folder: Path, run_name: str, config: dict[str, Any], config_text: str,
                 first_step: int = 0, go_on: bool = True) -> list[Logger]:
    """The trackers of ``names``; ``first_step``: the first step this process logs (a resumed
    run's step after its checkpoint), from which TensorBoard hides what an earlier process of
    the run logged, as ``metrics.jsonl`` drops those lines. A resumed run goes on in the W&B
    and MLflow runs of the process before it, unless not ``go_on`` (a roll-back: W&B would
    keep the values of the steps it trains again, which the roll-back is to replace)."""
    loggers: list[Logger] = []
    earlier = tracker_ids(folder) if first_step > 1 and go_on else {}
    for name in names:
        try:
            if name == "tensorboard":
                loggers.append(TensorBoardLogger(folder / "tensorboard", config_text, first_step))
            elif name == "wandb":
                loggers.append(WandbLogger(folder, run_name, config, earlier.get("wandb")))
            elif name == "mlflow":
                loggers.append(MlflowLogger(folder, run_name, config, config_text, earlier.get("mlflow")))
        except Exception as error:  # noqa: BLE001 - the tracker's own errors, said plainly
            for started in loggers:  # the ones already started end, marked failed
                close_quietly(started, {}, failed=True)
            raise FlowrlError(f"trainer.loggers: {name} could not start ({type(error).__name__}: "
                              f"{str(error)[:500]}); fix its settings or remove it from trainer.loggers") from error
    ids = {"wandb" if isinstance(logger, WandbLogger) else "mlflow": logger.run_id
           for logger in loggers if isinstance(logger, (WandbLogger, MlflowLogger))}
    if ids:
        (folder / TRACKER_IDS).write_text(json.dumps(ids, indent=1) + "\n")
    else:  # ids of an earlier run there must not reach a later process of this one
        (folder / TRACKER_IDS).unlink(missing_ok=True)
    return loggers


TRACKER_IDS = "trackers.json"
"""In the output folder: the W&B and MLflow run ids of the run, which a resume goes on in."""


def tracker_ids(folder: Path) -> dict[str, str]:
    """The trackers' run ids an earlier process of the run in ``folder`` wrote (none: {})."""
    try:
        ids = json.loads((folder / TRACKER_IDS).read_text())
    except (OSError, ValueError):
        return {}
    return {str(name): value for name, value in ids.items() if isinstance(value, str)} if isinstance(ids, dict) else {}


def close_quietly(logger: Logger, summary: dict[str, float], failed: bool) -> str | None:
    """End a logger; what went wrong, if anything, as one line (a tracker's failure never
    hides the run's own result or error)."""
    try:
        logger.close(summary, failed)
    except Exception as error:  # noqa: BLE001 - any tracker error
        return f"{type(logger).__name__}: {type(error).__name__}: {str(error)[:300]}"
    return None


class TensorBoardLogger:
    def __init__(self, directory: Path, config_text: str, first_step: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: events of this step and later left by an earlier process of the run
        # (killed, interrupted, or started over) are hidden, so no step shows twice
        self.directory = directory
        self.writer = SummaryWriter(log_dir=str(directory), purge_step=first_step if directory.is_dir() else None)
        # Markdown code block: TensorBoard's text tab renders it as written.
        self.writer.add_text("config", "```\n" + config_text + "\n```", global_step=0)

    def purge_from(self, step: int) -> None:
        """Hide the events of ``step`` and later logged so far: they are run again."""
        from torch.utils.tensorboard import SummaryWriter

        self.writer.close()
        self.writer = SummaryWriter(log_dir=str(self.directory), purge_step=step)

    def step(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self, summary: dict[str, float], failed: bool = False) -> None:
        text = json.dumps({**summary, "failed": failed}, indent=1)
        self.writer.add_text("summary", "```\n" + text + "\n```")
        self.writer.close()


class WandbLogger:
    def __init__(self, folder: Path, run_name: str, config: dict[str, Any], resume_id: str | None = None) -> None:
        """``resume_id``: the W&B run of an earlier process of this run, to go on in (W&B
        keeps the values it has of the steps this process runs again)."""
        import wandb

        mode: Any = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        again: dict[str, Any] = {"id": resume_id, "resume": "allow"} if resume_id else {}
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", run_name), dir=str(folder), config=config,
                              mode=mode, reinit="create_new", **again)
        self.run_id = str(self.run.id)

    def step(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self, summary: dict[str, float], failed: bool = False) -> None:
        self.run.summary.update(summary)
        self.run.finish(exit_code=1 if failed else 0)


_MLFLOW_KEY = re.compile(r"[^A-Za-z0-9_\-. /]")


def mlflow_key(name: str) -> str:
    """A metric or parameter name as MLflow accepts it (letters, digits, ``_-. /``)."""
    return _MLFLOW_KEY.sub("_", name)


class MlflowLogger:
    def __init__(self, folder: Path, run_name: str, config: dict[str, Any], config_text: str,
                 resume_id: str | None = None) -> None:
        """``resume_id``: the MLflow run of an earlier process of this run, to go on in (its
        metric history keeps both values of a step run again, each with its time)."""
        import mlflow

        self.mlflow = mlflow
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (folder / "mlruns").resolve().as_uri()
            # MLflow keeps its file store working on request (it suggests a database now):
            # a run folder that holds everything of the run is worth it.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        if resume_id is not None and self._reopened(resume_id):
            self.run_id = resume_id
            self.client.log_text(self.run_id, config_text, "config.yaml")  # as the resume runs it
            return
        experiment = self.client.get_experiment_by_name(run_name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(run_name)
        self.run_id = self.client.create_run(experiment_id, run_name=folder.name).info.run_id
        params = [mlflow.entities.Param(mlflow_key(key), str(value)[:6000]) for key, value in _flat(config).items()]
        for start in range(0, len(params), 100):  # the store takes at most 100 per batch
            self.client.log_batch(self.run_id, params=params[start:start + 100])
        self.client.log_text(self.run_id, config_text, "config.yaml")

    def _reopened(self, run_id: str) -> bool:
        """Mark the earlier process's run as running again; False where the store lost it."""
        try:
            self.client.get_run(run_id)
        except Exception:  # noqa: BLE001 - a store without the run: a new one is made
            return False
        self.client.update_run(run_id, status="RUNNING")
        return True

    def step(self, step: int, metrics: dict[str, float]) -> None:
        import time

        now = int(time.time() * 1000)
        entries = [self.mlflow.entities.Metric(mlflow_key(key), value, now, step) for key, value in metrics.items()]
        for start in range(0, len(entries), 1000):
            self.client.log_batch(self.run_id, metrics=entries[start:start + 1000])

    def close(self, summary: dict[str, float], failed: bool = False) -> None:
        self.client.log_dict(self.run_id, summary, "summary.json")
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists stay values)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flat(value, name + "."))
        else:
            flat[name] = value
    return flat
