"""A rank whose peer died or hung fails in its collective: that counts as the node's workers
hung (recovered), never as an error of the run."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from flowrl.errors import NodeTimeout
from flowrl.planner.placement import plan_for
from flowrl.runtime.executor import StepExecutor
from flowrl.runtime.waiting import peer_failed
from flowrl.spec.loader import pipeline_from_dict
from tests.integration.conftest import tiny_grpo

TWO = {"train": ["cpu-0", "cpu-1"]}
ALL_ON_0 = {"rollout": "cpu-0", "reward": "cpu-0", "ref": "cpu-0", "adv": "cpu-0", "train": "cpu-0"}


def _gloo_pair(timeout_s: float) -> dict[int, Any]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    groups: dict[int, Any] = {}

    def join(rank: int) -> None:
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=30))
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=timeout_s))

    threads = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return groups


def test_a_collective_whose_peer_never_comes_raises_what_peer_failed_recognises() -> None:
    groups = _gloo_pair(timeout_s=0.5)
    with pytest.raises(RuntimeError) as raised:
        groups[0].allreduce([torch.ones(4)]).wait()  # rank 1 never joins: as if stopped
    assert peer_failed(raised.value), raised.value
    # the text gloo gave in a run whose peer was stopped mid-update, and torch's own classes
    assert peer_failed(RuntimeError("Application timeout caused pair closure"))
    assert peer_failed(dist.DistBackendError("NCCL communicator was aborted on rank 1"))
    # the rank's own errors are not the peer's: its arithmetic, NCCL's report of this rank's
    # own CUDA error, a reward's lost HTTP connection, or a shard's error forwarded as an input's
    assert not peer_failed(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not peer_failed(ValueError("Timed out waiting"))
    assert not peer_failed(dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp, unhandled cuda error"))
    assert not peer_failed(ConnectionResetError(104, "Connection reset by peer"))
    from flowrl.runtime.host import UpstreamFailed

    assert not peer_failed(UpstreamFailed("input 'reward' failed: gloo Timed out waiting (from an HTTP judge)"))


class _Host:
    """Stands in for a role host: ``run_node`` returns a placeholder future."""

    def run_node(self, call: Any) -> Any:
        return call.node


def test_a_split_node_whose_rank_fails_in_its_collective_counts_as_hung(tmp_path: Path) -> None:
    graph = pipeline_from_dict(tiny_grpo(tmp_path / "out", steps=2).to_dict())
    plan = plan_for(graph, ALL_ON_0, node_shards=TWO)
    hosts = {"cpu-0": _Host(), "cpu-1": _Host()}

    def gather(calls: list[tuple[str, Any]], timeout_s: float, what: str) -> list[Any]:
        if what == "node 'train'":
            raise RuntimeError("Application timeout caused pair closure")
        return [None for _ in calls]

    executor = StepExecutor(graph, plan, hosts, 8.0, gather=gather)
    with pytest.raises(NodeTimeout) as hung:
        executor._collect("train", ["a", "b"])
    assert hung.value.slots == ("cpu-0", "cpu-1") and hung.value.collective
    assert "a collective of its group failed" in str(hung.value) and "pair closure" in str(hung.value)

    # one worker alone has no peer: its error is its own
    def own_error(calls: list[tuple[str, Any]], timeout_s: float, what: str) -> list[Any]:
        raise RuntimeError("Application timeout caused pair closure")

    single = StepExecutor(graph, plan_for(graph, ALL_ON_0), hosts, 8.0, gather=own_error)
    with pytest.raises(RuntimeError):
        single._collect("train", ["a"])


def test_an_update_whose_weight_broadcast_fails_counts_its_peers_hung_too(tmp_path: Path) -> None:
    graph = pipeline_from_dict(tiny_grpo(tmp_path / "out", steps=2).to_dict())
    # the actor generates on cpu-1 and trains on cpu-0: the update broadcasts to cpu-1
    plan = plan_for(graph, {**ALL_ON_0, "rollout": "cpu-1"})
    hosts = {"cpu-0": _Host(), "cpu-1": _Host()}

    def gather(calls: list[tuple[str, Any]], timeout_s: float, what: str) -> list[Any]:
        raise RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")

    with pytest.raises(NodeTimeout) as hung:
        StepExecutor(graph, plan, hosts, 8.0, gather=gather)._collect("train", ["a"])
    assert hung.value.slots == ("cpu-0", "cpu-1")
    # a worker found gone stays lost, whatever its error's context says
    from flowrl.errors import WorkerLost

    def lost(calls: list[tuple[str, Any]], timeout_s: float, what: str) -> list[Any]:
        try:
            raise RuntimeError("Application timeout caused pair closure")
        except RuntimeError:
            raise WorkerLost("node 'train': the worker of cpu-1 left the cluster", ("cpu-1",))

    with pytest.raises(WorkerLost):
        StepExecutor(graph, plan, hosts, 8.0, gather=lost)._collect("train", ["a"])
