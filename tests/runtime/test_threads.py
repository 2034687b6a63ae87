"""Torch threads per node call: cores divided by the workers that may compute beside it."""

from __future__ import annotations

from pathlib import Path

from flowrl.planner.placement import plan_for
from flowrl.runtime.threads import call_threads
from flowrl.spec.loader import load_pipeline

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"
SLOTS = {"cpu-0", "cpu-1"}


def test_grpo_nodes_that_run_one_after_another_get_every_core() -> None:
    pipeline = load_pipeline(PIPELINES / "grpo_tiny.yaml")
    # the models on cpu-0; the score and the advantage (light: no model) on cpu-1
    plan = plan_for(pipeline, {"rollout": "cpu-0", "reward": "cpu-1", "ref": "cpu-0", "adv": "cpu-1", "train": "cpu-0"})
    assert call_threads(pipeline, plan, 2, SLOTS) == {("rollout", "cpu-0"): 2, ("ref", "cpu-0"): 2, ("train", "cpu-0"): 2}
    # the reference on a worker of its own: generation and the update depend on it or it on
    # them, so nothing runs beside it
    plan = plan_for(pipeline, {"rollout": "cpu-0", "reward": "cpu-0", "ref": "cpu-1", "adv": "cpu-0", "train": "cpu-0"})
    assert set(call_threads(pipeline, plan, 4, SLOTS).values()) == {4}


def test_ppo_calls_that_may_run_at_once_on_two_workers_share_the_cores() -> None:
    pipeline = load_pipeline(PIPELINES / "ppo_tiny.yaml")
    plan = plan_for(pipeline, {"rollout": "cpu-0", "reward": "cpu-1", "ref": "cpu-0", "values": "cpu-1",
                               "adv": "cpu-0", "train_actor": "cpu-0", "train_critic": "cpu-1"})
    threads = call_threads(pipeline, plan, 4, SLOTS)
    assert threads[("rollout", "cpu-0")] == 4  # everything else waits for the rollout
    assert ("adv", "cpu-0") not in threads  # light: one thread wherever it runs
    # ref, the reward model and the values read the rollout side by side on both workers;
    # the two updates after the advantages likewise
    for call in (("ref", "cpu-0"), ("reward", "cpu-1"), ("values", "cpu-1"), ("train_actor", "cpu-0"),
                 ("train_critic", "cpu-1")):
        assert threads[call] == 2, call
    # the same calls all on one worker: nothing beside them on another
    alone = plan_for(pipeline, {node: "cpu-0" for node in plan.node_slots})
    assert set(call_threads(pipeline, alone, 4, SLOTS).values()) == {4}
    # a worker outside ``shared`` (pinned, or a GPU) is neither given threads nor counted
    assert ("values", "cpu-1") not in call_threads(pipeline, plan, 4, {"cpu-0"})
    assert call_threads(pipeline, plan, 4, {"cpu-0"})[("train_actor", "cpu-0")] == 4


def test_the_parts_of_a_split_node_share_the_cores_and_three_workers_leave_one_each() -> None:
    pipeline = load_pipeline(PIPELINES / "grpo_tiny.yaml")
    plan = plan_for(pipeline, {"rollout": "cpu-0", "reward": "cpu-0", "ref": "cpu-0", "adv": "cpu-0", "train": "cpu-0"},
                    node_shards={"ref": ["cpu-0", "cpu-1", "cpu-2"]})
    threads = call_threads(pipeline, plan, 3, {"cpu-0", "cpu-1", "cpu-2"})
    assert [threads[("ref", slot)] for slot in ("cpu-0", "cpu-1", "cpu-2")] == [1, 1, 1]
    assert threads[("train", "cpu-0")] == 3
    assert call_threads(pipeline, plan, 2, {"cpu-0", "cpu-1", "cpu-2"})[("ref", "cpu-2")] == 1  # never 0


def test_light_calls_run_on_one_thread_and_model_calls_on_their_share() -> None:
    from flowrl.runtime.executor import LIGHT_THREADS, StepExecutor

    pipeline = load_pipeline(PIPELINES / "grpo_tiny.yaml")
    plan = plan_for(pipeline, {node: "cpu-0" for node in pipeline.spec.nodes})
    executor = StepExecutor(pipeline, plan, {}, 60.0, threads=call_threads(pipeline, plan, 4, SLOTS))
    threads = {node: executor._call(1, node, [], 0.0, "cpu-0").threads for node in pipeline.spec.nodes}
    assert LIGHT_THREADS == 1
    assert threads == {"rollout": 4, "reward": 1, "ref": 4, "adv": 1, "train": 4}


def test_a_light_call_runs_on_one_thread_and_leaves_the_worker_its_own() -> None:
    """A reward function's call gets one thread; what the compute thread runs next (an
    evaluation, a weight push, a checkpoint) has the worker's own count again."""
    import asyncio

    import torch

    from flowrl.runtime.calls import InputRef, NodeCall, store_key
    from flowrl.runtime.host import RoleHost
    from tests.tiny_models import build_char_tokenizer, text_rollout

    pipeline = load_pipeline(PIPELINES / "grpo_tiny.yaml")
    host = RoleHost("cpu-0", "cpu", 2, 0, None, sample_interval_s=60.0)
    seen: list[int] = []
    rollout = text_rollout(build_char_tokenizer(), ["1+1=", "2+2="], ["2", "5"], 2, 4)
    rollout.answers = ["2", "4"]
    key = store_key(1, "rollout", 0)
    host.store[key] = rollout
    host._event(key).set()
    call = NodeCall(step=1, node="reward", role="score", spec=pipeline.spec.nodes["reward"], model=None,
                    inputs=(InputRef("rollout", "generate", key, None, rollout=True),), group_size=2, threads=1)
    original = host._dispatch

    def dispatch(call: NodeCall, inputs: dict) -> object:
        seen.append(torch.get_num_threads())
        return original(call, inputs)

    host._dispatch = dispatch  # type: ignore[method-assign]
    report = asyncio.run(host.run_node(call))
    assert seen == [1] and report.metrics
    assert host._compute.submit(torch.get_num_threads).result() == 2


def test_a_hosts_sampler_and_compute_threads_end_when_it_is_dropped_or_forgotten() -> None:
    """A joined cluster's workers serve run after run: each run's hosts must take their
    threads with them, whether their session drops them or Dask forgets the object."""
    import gc
    import threading

    import torch

    from flowrl.runtime.host import RoleHost

    def sampler_of(name: str) -> threading.Thread:
        return next(thread for thread in threading.enumerate() if thread.name == f"flowrl-sampler-{name}")

    threads_before = torch.get_num_threads()  # a host sets its worker's threads: this process's here
    try:
        dropped = RoleHost("drop-me", "cpu", 1, 0, None, sample_interval_s=60.0)
        assert dropped._compute.submit(lambda: 1).result() == 1
        threads = [sampler_of("drop-me"), *dropped._compute._threads]
        dropped.drop_all()
        for thread in threads:
            thread.join(timeout=10)
            assert not thread.is_alive(), thread.name

        forgotten = RoleHost("forget-me", "cpu", 1, 0, None, sample_interval_s=60.0)
        sampler = sampler_of("forget-me")
        del forgotten
        gc.collect()
        sampler.join(timeout=10)
        assert not sampler.is_alive()
    finally:
        torch.set_num_threads(threads_before)
