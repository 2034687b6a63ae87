"""One flowrl GRPO run for ``vs_trl.py``, in a process of its own.

    python benchmarks/_flowrl_runner.py JOB_JSON RESULT_PATH

``vs_trl.py`` starts this file as a child process so that its memory (the driver plus the
Dask workers it spawns) can be measured apart from everything else, and writes the job as
JSON. Top-level imports stay light: Dask's worker processes re-import this file.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def build_pipeline(job: dict[str, Any], output_dir: str) -> Any:
    """The GRPO job of ``pipelines/grpo_tiny.yaml``, with the benchmark's shape and settings.

    ``job["device"] == "cuda"``: actor and reference share one GPU group, in ``job["dtype"]``.
    """
    from flowrl.api.builder import Pipeline

    model_path = f"builtin:{job['model']}"
    on_gpu = job.get("device", "cpu") == "cuda"
    dtype = job.get("dtype", "fp32")
    p = Pipeline(f"vs-trl-{job['config']}")
    lora = {"lora": {"rank": job["lora_rank"]}} if job.get("lora_rank") else {}
    actor = p.model("actor", path=model_path, group="actor_group", dtype=dtype, **lora)
    # "planned": two groups as in the default pipeline, placed by the planner (which may let
    # them share a worker); "separate": the reference's group kept to itself (exclusive);
    # "colocated": one group for both models (on a GPU always).
    layout = job.get("layout", "planned")
    colocated = on_gpu or layout == "colocated"
    # with adapters the reference is the actor's frozen weights (adapters off), as in TRL with peft
    reference = actor if lora else p.model(
        "reference", path=model_path, group="actor_group" if colocated else "ref_group", dtype=dtype)
    p.devices("actor_group", type="gpu" if on_gpu else "cpu")
    if not colocated and not lora:
        p.devices("ref_group", type="cpu", exclusive=layout == "separate")
    prompts = p.source("builtin:digits", batch_size=job["prompts_per_step"])
    rollout = p.generate(
        actor, prompts, n=job["num_generations"], max_new_tokens=job["max_new_tokens"],
        temperature=job["temperature"], top_p=job["top_p"], top_k=0, engine=job.get("engine", "auto"),
    )
    reward = p.score("digits", rollout)
    ref = p.reference_logprob(reference, rollout, micro_batch_tokens=job.get("ref_micro_batch_tokens"))
    # TRL divides by (group std + 1e-4); flowrl's default epsilon is 1e-6.
    adv = p.advantage("grpo", reward, scale_by_std=True, epsilon=job["advantage_epsilon"])
    p.update(
        actor, rollout, adv, ref,
        lr=job["lr"], kl_coef=job["beta"], kl_estimator="k3", clip_eps=job["epsilon"],
        loss_agg="token_mean", ppo_epochs=1, mini_batch_size=None,
        micro_batch_tokens=job.get("update_micro_batch_tokens"),
        max_grad_norm=job["max_grad_norm"], weight_decay=job["weight_decay"], betas=tuple(job["betas"]),
    )
    p.trainer(steps=job["steps"], seed=job["seed"], output_dir=output_dir, checkpoint_every=0)
    p.runtime(cpu_slots=job["cpu_slots"])
    return p


class _Recorder:
    """An observer for ``run()``: wall-clock times of steps and events."""

    def __init__(self) -> None:
        self.step_end_s: list[float] = []
        self.events: list[dict[str, Any]] = []
        self.first_step_start_unix: float | None = None

    def on_step(self, record: Any) -> None:
        self.step_end_s.append(time.perf_counter())
        if len(self.step_end_s) == 1:
            self.first_step_start_unix = time.time() - record.metrics["timing_s/step"]

    def on_event(self, event: Any) -> None:
        self.events.append({"t_s": time.perf_counter(), "kind": event.kind, "message": event.message})


def run_flowrl(job: dict[str, Any]) -> dict[str, Any]:
    from flowrl.api.run import run

    # The builtin weights are already in the cache: ``vs_trl.py`` builds them in a process of
    # its own before any timed run, so this driver imports what `flowrl run` imports.
    output_dir = tempfile.mkdtemp(prefix="flowrl-vs-trl-")
    recorder = _Recorder()
    try:
        pipeline = build_pipeline(job, output_dir)
        graph = pipeline.build()
        started = time.perf_counter()
        result = run(graph, observer=recorder)
        finished = time.perf_counter()
    finally:
        shutil.rmtree(output_dir, ignore_errors=True)

    records = result.records
    metric_names = sorted({key for record in records for key in record.metrics})
    per_step = {name: [record.metrics.get(name) for record in records] for name in metric_names}
    num_sequences = job["prompts_per_step"] * job["num_generations"]
    step_s = per_step["timing_s/step"]
    # The first step starts when run() hands it the prompts: its end minus its own duration.
    first_step_start = recorder.step_end_s[0] - step_s[0] if records else finished
    for event in recorder.events:
        event["t_s"] -= started
    return {
        "framework": "flowrl",
        "step_s": step_s,
        # End of one step to the end of the next: adds device sampling and metric files.
        "loop_step_s": [b - a for a, b in zip(recorder.step_end_s, recorder.step_end_s[1:])],
        "reward_mean": per_step["critic/score/mean"],
        "completion_tokens": [m * num_sequences for m in per_step["response_length/mean"]],
        "startup_s": first_step_start - started,
        "first_step_start_unix": recorder.first_step_start_unix,
        "shutdown_s": finished - recorder.step_end_s[-1] if records else 0.0,
        "total_s": finished - started,
        "metrics": per_step,
        "node_devices": {t.node: t.device for t in records[0].nodes} if records else {},
        "events": recorder.events,
        "settings": {"pipeline": graph.to_dict()},
    }


def main() -> None:
    # What `flowrl run` does first: the server local workers fork from starts importing
    # torch and transformers while this process imports flowrl.
    from flowrl.runtime.warm_server import start_warm_server

    start_warm_server()
    job = json.loads(sys.argv[1])
    result = run_flowrl(job)
    Path(sys.argv[2]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
