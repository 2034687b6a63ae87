"""trainer.loggers and runtime.prometheus_port on a real run: TensorBoard event files, an MLflow
file store and a W&B offline run are read back with each tool's own reader (W&B's run file by
its record format) and hold what metrics.jsonl holds; /metrics is scraped over HTTP while the
run goes and parsed; a missing package and a busy port are clear errors before step 1."""

from __future__ import annotations

import json
import socket
import struct
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from flowrl.api.run import check_runnable, run
from flowrl.errors import FlowrlError
from flowrl.records import RunEvent, StepRecord
from flowrl.spec.loader import load_pipeline

PIPELINE = Path(__file__).resolve().parents[2] / "pipelines" / "grpo_tiny.yaml"
REWARD = "critic/rewards/mean"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Scraper:
    """Reads /metrics after every step, as Prometheus would."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.scrapes: list[dict[str, dict[tuple[tuple[str, str], ...], float]]] = []
        self.messages: list[str] = []

    def on_step(self, record: StepRecord) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10).read().decode()
        families: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                families.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
        self.scrapes.append(families)

    def on_event(self, event: RunEvent) -> None:
        self.messages.append(event.message)


def _wandb_records(path: Path) -> list[Any]:
    """The records of a W&B run file: a header, then 32 KiB blocks of chunks (crc, length,
    kind: whole, first, middle, last), each record a protobuf ``Record``."""
    from wandb.proto import wandb_internal_pb2

    raw = path.read_bytes()
    block, position, pending, records = 32768, 7, b"", []
    while position + 7 <= len(raw):
        left = block - position % block
        if left < 7:
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[position:position + 7])
        position += 7
        if kind == 0 and length == 0:
            position += left - 7
            continue
        chunk = raw[position:position + length]
        position += length
        if kind == 1:
            records.append(chunk)
        elif kind in (2, 3):
            pending += chunk
        elif kind == 4:
            records.append(pending + chunk)
            pending = b""
    parsed = []
    for data in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        parsed.append(record)
    return parsed


def _key(item: Any) -> str:
    return "/".join(item.nested_key) or item.key


def test_every_logger_and_prometheus_get_the_runs_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    port = _free_port()
    scraper = Scraper(port)
    output = tmp_path / "out"
    # the reference on a worker of its own: both workers' devices are reported
    graph = load_pipeline(PIPELINE, ["trainer.steps=3", "trainer.loggers=[jsonl,tensorboard,wandb,mlflow]",
                                     f"runtime.prometheus_port={port}", "devices.ref_group.exclusive=true"])
    run(graph, output_dir=output, observer=scraper)
    lines = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    rewards = {line["step"]: line[REWARD] for line in lines}
    assert sorted(rewards) == [1, 2, 3]

    # TensorBoard: scalars per step, the config as text
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(output / "tensorboard"))
    events.Reload()
    assert {event.step: event.value for event in events.Scalars(REWARD)} == pytest.approx(rewards)
    assert "config/text_summary" in events.Tags()["tensors"]

    # MLflow: the file store in the output folder, with params, metrics and the summary
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=(output / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name(graph.spec.name)
    assert experiment is not None
    (found,) = client.search_runs([experiment.experiment_id])
    history = client.get_metric_history(found.info.run_id, REWARD)
    assert {metric.step: metric.value for metric in history} == pytest.approx(rewards)
    assert found.data.params["trainer.steps"] == "3"
    assert found.info.status == "FINISHED"
    summary = client.download_artifacts(found.info.run_id, "summary.json", str(tmp_path))
    assert json.loads(Path(summary).read_text())["steps"] == 3.0

    # W&B: an offline run folder whose run file holds the config, every step and the summary
    (run_file,) = (output / "wandb").glob("offline-run-*/run-*.wandb")
    records = _wandb_records(run_file)
    history = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {_key(item): json.loads(item.value_json) for item in record.history.item}
            history[items["_step"]] = items[REWARD]
    assert history == pytest.approx(rewards)
    config_keys = {_key(item) for record in records if record.WhichOneof("record_type") in ("run", "config")
                   for item in (record.run.config.update if record.HasField("run") else record.config.update)}
    assert {"trainer", "nodes", "models"} <= config_keys
    summary_keys = {_key(item) for record in records if record.WhichOneof("record_type") == "summary"
                    for item in record.summary.update}
    assert {"steps", "elapsed_s"} <= summary_keys

    # Prometheus: scraped after every step, the step's numbers in it
    assert len(scraper.scrapes) == 3
    last = scraper.scrapes[-1]
    assert last["flowrl_step"][()] == 3.0
    assert last["flowrl_reward_mean"][()] == pytest.approx(lines[-1]["critic/score/mean"])
    assert {labels[0][1] for labels in last["flowrl_node_seconds"]} >= {"rollout", "ref", "train"}
    assert all(value > 0 for value in last["flowrl_node_seconds"].values())
    assert {labels[0][1] for labels in last["flowrl_device_utilization"]} == {"cpu-0", "cpu-1"}
    assert last["flowrl_faults_total"][()] == 0.0
    # every number of the step's metrics line, by its name there
    metric = {labels[0][1]: value for labels, value in last["flowrl_metric"].items()}
    for name in ("actor/pg_loss", "actor/grad_norm", "actor/lr", "timing_s/step"):
        assert metric[name] == pytest.approx(lines[-1][name]), name
    # runtime.dashboard is off: no dashboard is announced
    assert not any(message.startswith("Dask dashboard") for message in scraper.messages)
    # the server is gone after the run
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def _uninstalled(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    """``package`` looks not installed to the checks made before a run starts."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))


def test_a_logger_without_its_package_is_refused_before_start(monkeypatch: pytest.MonkeyPatch) -> None:
    _uninstalled(monkeypatch, "wandb")
    graph = load_pipeline(PIPELINE, ["trainer.loggers=[jsonl,wandb]"])
    with pytest.raises(FlowrlError, match=r"trainer.loggers: 'wandb' needs the wandb package.*flowrl\[wandb\]"):
        check_runnable(graph)


def test_a_busy_prometheus_port_is_a_clear_error() -> None:
    from flowrl.api.prometheus import PrometheusMetrics

    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(FlowrlError, match=rf"runtime.prometheus_port: cannot serve /metrics on port {port}"):
            PrometheusMetrics(port)


def test_the_dask_dashboard_needs_bokeh_before_start(monkeypatch: pytest.MonkeyPatch) -> None:
    _uninstalled(monkeypatch, "bokeh")
    graph = load_pipeline(PIPELINE, ["runtime.dashboard=true"])
    with pytest.raises(FlowrlError, match=r"runtime.dashboard: Dask's dashboard needs the bokeh package.*flowrl\[dashboard\]"):
        check_runnable(graph)


class Events:
    def __init__(self) -> None:
        self.messages: list[str] = []
        self.metrics_text = ""

    def on_step(self, record: StepRecord) -> None:
        if not self.metrics_text:
            link = next(m for m in self.messages if m.startswith("Dask dashboard: "))
            url = link.split("Dask's Prometheus metrics: ")[1]
            self.metrics_text = urllib.request.urlopen(url, timeout=10).read().decode()

    def on_event(self, event: RunEvent) -> None:
        self.messages.append(event.message)


def test_a_run_with_the_dashboard_names_it_and_dasks_prometheus_endpoint(tmp_path: Path) -> None:
    events = Events()
    graph = load_pipeline(PIPELINE, ["trainer.steps=1", "runtime.dashboard=true"])
    run(graph, output_dir=tmp_path / "out", observer=events)
    assert any(m.startswith("Dask dashboard: http://127.0.0.1:") and m.endswith("/metrics") for m in events.messages)
    assert "dask_scheduler_workers" in events.metrics_text  # Dask's own series, scraped mid-run


class Broken:
    """A tracker that fails: at a step, and again when it is closed."""

    def __init__(self) -> None:
        self.closed: list[bool] = []

    def step(self, step: int, metrics: dict[str, float]) -> None:
        raise ConnectionError("tracking server unreachable")

    def close(self, summary: dict[str, float], failed: bool = False) -> None:
        self.closed.append(failed)
        raise ConnectionError("still unreachable")


class Kept:
    def __init__(self) -> None:
        self.steps: list[int] = []
        self.closed: list[tuple[dict[str, float], bool]] = []

    def step(self, step: int, metrics: dict[str, float]) -> None:
        self.steps.append(step)

    def close(self, summary: dict[str, float], failed: bool = False) -> None:
        self.closed.append((summary, failed))


def test_a_failing_tracker_is_dropped_with_a_warning_and_never_stops_the_run(tmp_path: Path) -> None:
    from flowrl.api.outputs import RunFolder
    from flowrl.api.run import _Watchers

    watchers = _Watchers(RunFolder(tmp_path), None)
    broken, kept = Broken(), Kept()
    watchers.loggers = [broken, kept]
    for step in (1, 2):
        watchers.step(StepRecord(step, 2, {"critic/score/mean": 0.5, "nan": float("nan")}))
    assert watchers.loggers == [kept] and kept.steps == [1, 2] and broken.closed == [True]
    watchers.close(failed=True)  # the run stopped with an error: trackers are told so
    assert kept.closed == [({"critic/score/mean": 0.5, "steps": 2.0, "elapsed_s": 0.0}, True)]
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["kind"] for e in events] == ["warning"]
    assert "Broken stopped at step 1 (ConnectionError: tracking server unreachable)" in events[0]["message"]


def test_a_tracker_that_cannot_finish_is_reported_not_raised(tmp_path: Path) -> None:
    from flowrl.api.outputs import RunFolder
    from flowrl.api.run import _Watchers

    watchers = _Watchers(RunFolder(tmp_path), None)
    broken, kept = Broken(), Kept()
    watchers.loggers = [broken, kept]
    watchers.close()
    assert broken.closed == [False] and kept.closed == [({}, False)]
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert "could not finish Broken: ConnectionError: still unreachable" in events[0]["message"]


def test_a_tracker_that_cannot_start_ends_the_ones_started_before_it(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import mlflow

    import flowrl.api.loggers as loggers

    def refuse(*args: object, **kwargs: object) -> None:
        raise PermissionError("no write access")

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(loggers, "WandbLogger", refuse)
    with pytest.raises(FlowrlError, match=r"trainer.loggers: wandb could not start \(PermissionError: no write access\)"):
        loggers.make_loggers(("mlflow", "wandb"), tmp_path, "p", {"a": 1}, "a: 1\n")
    client = mlflow.MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("p")
    assert experiment is not None
    (found,) = client.search_runs([experiment.experiment_id])
    assert found.info.status == "FAILED"


def test_the_evaluation_before_training_reaches_the_trackers_as_step_0(tmp_path: Path) -> None:
    from flowrl.api.outputs import RunFolder
    from flowrl.api.run import _Watchers

    watchers = _Watchers(RunFolder(tmp_path), None)
    kept = Kept()
    watchers.loggers = [kept]
    watchers.evaluated(StepRecord(0, 2, {"val/reward/mean": 0.25}))
    watchers.step(StepRecord(1, 2, {"critic/score/mean": 0.5}))
    assert kept.steps == [0, 1]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1] and lines[0]["val/reward/mean"] == 0.25
    assert watchers.last is not None and watchers.last.step == 1  # step 0 trained nothing


def test_tensorboard_hides_the_steps_a_resumed_run_runs_again(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from flowrl.api.loggers import TensorBoardLogger

    first = TensorBoardLogger(tmp_path / "tensorboard", "config")
    for step in (1, 2, 3):
        first.step(step, {REWARD: float(step)})
    first.close({})  # a run killed after step 3, resumed from its checkpoint of step 1
    again = TensorBoardLogger(tmp_path / "tensorboard", "config", first_step=2)
    for step in (2, 3, 4):
        again.step(step, {REWARD: 10.0 * step})
    again.purge_from(4)  # a fault in this process: back to the snapshot of step 3
    again.step(4, {REWARD: 400.0})
    again.close({})
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(event.step, event.value) for event in events.Scalars(REWARD)] == [
        (1, 1.0), (2, 20.0), (3, 30.0), (4, 400.0)]


def test_a_resumed_run_goes_on_in_the_trackers_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process resumed from a checkpoint logs into the W&B and MLflow runs of the one
    before it (their ids kept in trackers.json); a fresh start makes new ones."""
    import mlflow

    from flowrl.api import loggers

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    names = ("jsonl", "wandb", "mlflow")
    first = loggers.make_loggers(names, tmp_path, "p", {"a": 1}, "a: 1\n")
    for logger in first:
        logger.step(1, {REWARD: 0.5})
        logger.close({}, failed=True)  # killed after step 1 (its checkpoint)
    ids = loggers.tracker_ids(tmp_path)
    assert set(ids) == {"wandb", "mlflow"}
    resumed = loggers.make_loggers(names, tmp_path, "p", {"a": 1}, "a: 1\n", first_step=2)
    assert {type(logger).__name__: logger.run_id for logger in resumed} == {  # type: ignore[attr-defined]
        "WandbLogger": ids["wandb"], "MlflowLogger": ids["mlflow"]}
    for logger in resumed:
        logger.step(2, {REWARD: 0.75})
        logger.close({}, failed=False)
    client = mlflow.MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    run = client.get_run(ids["mlflow"])
    assert run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(ids["mlflow"], REWARD)] == [(1, 0.5), (2, 0.75)]
    rolled_back = loggers.make_loggers(names, tmp_path, "p", {"a": 1}, "a: 1\n", first_step=2, go_on=False)
    assert all(logger.run_id not in ids.values() for logger in rolled_back)  # type: ignore[attr-defined]
    for logger in rolled_back:
        logger.close({}, failed=False)
    fresh = loggers.make_loggers(names, tmp_path, "p", {"a": 1}, "a: 1\n")
    assert all(logger.run_id not in ids.values() for logger in fresh)  # type: ignore[attr-defined]
    for logger in fresh:
        logger.close({}, failed=False)
    # a later run there without these trackers leaves no ids for a resume that adds them
    loggers.make_loggers(("jsonl",), tmp_path, "p", {"a": 1}, "a: 1\n")
    assert loggers.tracker_ids(tmp_path) == {} and not (tmp_path / "trackers.json").exists()
