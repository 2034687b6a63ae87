from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

from flowrl.api.builder import Pipeline


def tiny_grpo(output_dir: Path, steps: int, kl_coef: float = 0.02, checkpoint_every: int = 0,
              reward: str = "digits", lr: float = 5e-4, runtime: dict[str, Any] | None = None,
              own_ref_worker: bool = True, **trainer: Any) -> Pipeline:
    """The default pipeline's shape, small enough for a test. ``own_ref_worker``: the
    reference group is exclusive, so runs use (and tests can break) two workers; without it
    the planner places the groups as it would the shipped pipeline."""
    p = Pipeline("test-grpo")
    if own_ref_worker:
        p.devices("ref_group", type="cpu", exclusive=True)
    actor = p.model("actor", path="builtin:tiny-llama", group="actor_group")
    reference = p.model("reference", path="builtin:tiny-llama", group="ref_group")
    prompts = p.source("builtin:digits", batch_size=4)
    rollout = p.generate(actor, prompts, n=8, max_new_tokens=16)
    scores = p.score(reward, rollout)
    inputs = [rollout]
    if kl_coef > 0:
        inputs.append(p.reference_logprob(reference, rollout))
    advantage = p.advantage("grpo", scores)
    p.update(actor, rollout, advantage, *inputs[1:], lr=lr, kl_coef=kl_coef)
    p.trainer(steps=steps, output_dir=str(output_dir), seed=0, checkpoint_every=checkpoint_every, keep_checkpoints=2,
              **trainer)
    # No warm spare unless a test asks: most runs here last seconds, and a spare importing
    # torch beside them only slows the suite on 2 cores. A snapshot every step, so a fault
    # test knows which step its run goes back to (the run's own cadence depends on its speed).
    p.runtime(**{"standby_workers": 0, "snapshot_every": 1, **(runtime or {})})
    return p


class StopAtStep:
    """An observer that stops the run (as Ctrl-C does) when step ``step``'s record arrives:
    that step is lost with the driver, the checkpoints before it are on disk."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step(self, record: Any) -> None:
        if record.step == self.step:
            raise KeyboardInterrupt

    def on_event(self, event: Any) -> None:
        pass


@pytest.fixture
def make_pipeline() -> Callable[..., Pipeline]:
    return tiny_grpo
