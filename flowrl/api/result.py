"""What a run gives back and takes: ``RunResult`` (and ``load_run``, the same read back from an
output folder), and the observer a run reports its steps and events to."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from flowrl.api.outputs import finished_steps, step_line
from flowrl.errors import FlowrlError
from flowrl.records import RunEvent, StepRecord


class Observer(Protocol):
    def on_step(self, record: StepRecord) -> None: ...
    def on_event(self, event: RunEvent) -> None: ...


class _Partial:
    """An observer that has only one of ``on_step`` and ``on_event``: the other does nothing."""

    def __init__(self, observer: object) -> None:
        self._observer = observer

    def on_step(self, record: StepRecord) -> None:
        method = getattr(self._observer, "on_step", None)
        if callable(method):
            method(record)

    def on_event(self, event: RunEvent) -> None:
        method = getattr(self._observer, "on_event", None)
        if callable(method):
            method(event)


def as_observer(observer: object) -> Observer | None:
    """``observer`` as the run calls it: one of its two methods may be missing (it is then
    not called); an object with neither is refused."""
    if observer is None:
        return None
    has = [name for name in ("on_step", "on_event") if callable(getattr(observer, name, None))]
    if not has:
        raise FlowrlError(f"observer: a value of type {type(observer).__name__} has neither on_step(record) nor on_event(event); "
                          "give it one or both")
    return observer if len(has) == 2 else _Partial(observer)  # type: ignore[return-value]


@dataclass
class RunResult:
    output_dir: Path
    records: list[StepRecord] = field(default_factory=list)
    already_finished: bool = False
    """``resume`` found a run that had finished every step: nothing was trained."""
    finished_steps: int = 0
    """The steps the run has finished: a run that returns, every step asked for; with
    ``already_finished``, the steps that run had finished (at least those asked for);
    ``load_run``, the steps the folder's run finished (0 until it ends)."""
    evaluations: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    """(step, ``val/*`` metrics) of every evaluation; step 0 is before training."""

    def metric(self, name: str) -> list[float]:
        """The steps' values of metric ``name`` (the steps that have it: ``val/*`` only at an
        evaluation after a step; :meth:`steps_of` adds the steps, and the evaluation before
        training). A name no step has is a KeyError naming the closest ones (metrics of a
        score node are named after the node, not its function)."""
        values = [r.metrics[name] for r in self.records if name in r.metrics]
        if not values and self.records:
            known = sorted({key for record in self.records for key in record.metrics})
            close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(repr(item) for item in close)}?" if close else ""
            raise KeyError(f"no step of this run has the metric {name!r}{hint}")
        return values

    def steps_of(self, name: str) -> list[tuple[int, float]]:
        """(step, value) of metric ``name`` at every step that has it; of a ``val/*`` metric,
        at every evaluation, the one before training (step 0) included. A name no step has is
        a KeyError, as for :meth:`metric`."""
        pairs = dict((record.step, record.metrics[name]) for record in self.records if name in record.metrics)
        pairs.update((step, values[name]) for step, values in self.evaluations if name in values)
        if not pairs:
            self.metric(name)  # the KeyError naming the closest names
        return sorted(pairs.items())


def load_run(output_dir: str | Path) -> RunResult:
    """The steps a run in ``output_dir`` logged, read back from its ``metrics.jsonl``: every
    step of every process that trained there (a resumed run's first steps too), each with its
    metrics, and the evaluations (step 0 is the one before training). The per-node timings
    stay in ``profile.jsonl``."""
    folder = Path(output_dir)
    path = folder / "metrics.jsonl"
    if not path.is_file():
        raise FlowrlError(f"{folder} holds no metrics.jsonl: it is not the output folder of a flowrl run")
    lines = []
    texts = path.read_text().splitlines()
    for number, text in enumerate(texts, start=1):
        try:
            lines.append(step_line(text))
        except ValueError as error:
            if number == len(texts):
                break  # the last line, cut short by a killed process (as a resume drops it)
            raise FlowrlError(f"{path}:{number} is not a metrics line ({error})") from error
    num_steps = max((step for step, _ in lines), default=0)
    finished = finished_steps(folder)
    result = RunResult(folder.resolve(), finished_steps=finished or 0)
    for step, line in lines:
        elapsed_s = float(line.pop("elapsed_s", 0.0) or 0.0)
        metrics = {key: float("nan") if value is None else float(value) for key, value in line.items()
                   if isinstance(value, (int, float)) or value is None}
        values = {key: value for key, value in metrics.items() if key.startswith("val/")}
        if values:
            result.evaluations.append((step, values))
        if step > 0:
            result.records.append(StepRecord(step, num_steps, metrics, elapsed_s=elapsed_s))
    return result
