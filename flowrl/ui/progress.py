"""Step progress shared by the live view and the plain log: metric keys and the ETA.

The ETA is the mean time of the most recent steps times the steps left. A window
rather than the whole run, because the first steps pay for warm-up (model load,
compilation) and would keep the estimate too high for the rest of the run.
"""

from __future__ import annotations

from collections import deque

REWARD_KEY = "critic/score/mean"
"""Mean sequence reward of the step (verl's name)."""
FAILED_SHARE_KEY = "reward/failed_share"
NUM_FAILED_KEY = "reward/num_failed"
"""Share of samples whose reward function failed (scored 0)."""


def failed_shares(metrics: dict[str, float]) -> dict[str | None, float]:
    """The share of samples whose reward function failed, per score node where the step had
    several (``reward/<node>/failed_share``: a node failing on every sample beside a working
    one shows as 100 %, not as their mean), else for the step (key None); only shares above 0."""
    per_node = {key.split("/")[1]: value for key, value in metrics.items()
                if key.startswith("reward/") and key.endswith("/failed_share") and key.count("/") == 2}
    if per_node:
        return {name: share for name, share in per_node.items() if share > 0}
    share = metrics.get(FAILED_SHARE_KEY, 0.0)
    return {None: share} if share > 0 else {}


RESPONSE_LENGTH_KEY = "response_length/mean"
"""Mean completion length in tokens."""
STEP_TIME_KEY = "timing_s/step"
"""Wall time of the whole step in seconds."""
THROUGHPUT_KEY = "perf/throughput"
"""Tokens per second over the whole step."""

ETA_WINDOW_STEPS = 10
"""How many recent steps the ETA averages over."""


class EtaEstimator:
    """Seconds left in a run, from the ``(step, elapsed_s)`` of finished steps.

    ``StepRecord.step`` is the 1-based number of the finished step, so after step ``k``
    of ``N`` there are ``N - k`` steps left.
    """

    def __init__(self, window_steps: int = ETA_WINDOW_STEPS) -> None:
        # One extra point: a window of k step durations needs k + 1 marks.
        self._marks: deque[tuple[int, float]] = deque(maxlen=window_steps + 1)
        self._restarted = False
        self._first_step = 1

    def add(self, step: int, elapsed_s: float, first_step: int = 1) -> None:
        """Remember that ``step`` finished ``elapsed_s`` seconds after step ``first_step`` of
        this process's run started (a resumed run's clock starts at its first step after the
        checkpoint)."""
        if self._marks and step <= self._marks[-1][0]:
            # A resumed or repeated step restarts the window: old marks are another run's clock.
            self._marks.clear()
            self._restarted = True
        self._marks.append((step, elapsed_s))
        self._first_step = first_step

    def seconds_per_step(self) -> float | None:
        """Mean step time over the window; ``None`` before the first step."""
        if not self._marks:
            return None
        if len(self._marks) == 1:
            if self._restarted:
                # A replay from an older snapshot: elapsed / step would count the replayed
                # steps' first pass too. Unknown until the next step.
                return None
            step, elapsed_s = self._marks[0]
            ran = step - self._first_step + 1
            return elapsed_s / ran if ran > 0 else None
        first_step, first_s = self._marks[0]
        last_step, last_s = self._marks[-1]
        return (last_s - first_s) / (last_step - first_step)

    def eta_s(self, num_steps: int, since_last_step_s: float = 0.0) -> float | None:
        """Seconds until step ``num_steps`` finishes, ``since_last_step_s`` after the last mark."""
        per_step_s = self.seconds_per_step()
        if per_step_s is None:
            return None
        last_step = self._marks[-1][0]
        steps_left = max(0, num_steps - last_step)
        if steps_left == 0:
            return 0.0
        return max(0.0, per_step_s * steps_left - since_last_step_s)
