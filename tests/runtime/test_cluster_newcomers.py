"""A joined cluster's lost slot and the workers that join after the run started: asked about
their devices once, within a deadline, refused with a reason when they cannot serve."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Any

import pytest

from flowrl.runtime import cluster as cluster_module
from flowrl.runtime.cluster import Cluster
from tests.runtime.test_cluster_gpu_slots import machine, slot


class Answers:
    """The one Dask client call a newcomer's probe makes (``run`` on one worker), answered by
    ``answer(address)``; counts the calls."""

    def __init__(self, answer: Any) -> None:
        self.answer, self.calls = answer, 0

    def run(self, function: Any, workers: list[str]) -> dict[str, Any]:
        self.calls += 1
        return {workers[0]: self.answer(workers[0])}


def joined(client: Answers, workers: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch) -> Cluster:
    """GPU slot w1 (card 0 of host a) and CPU slot w2 (host a); ``workers``: (name, host) of
    every worker registered now."""
    monkeypatch.setattr(cluster_module, "registered_workers",
                        lambda _client: {f"tcp://{host}:{name}": {"name": name, "host": host} for name, host in workers})
    gpu = replace(slot("w1", "a"), kind="gpu", gpu_index=0)
    return Cluster(client, [gpu, slot("w2", "a")], None,  # type: ignore[arg-type]
                   {"w1": machine("a", 2), "w2": machine("a", 2)})


def report(host: str, visible: str | None, gpus: int = 2, gpu_resource: float = 0.0) -> dict[str, Any]:
    raw = machine(host, gpus).to_dict()
    raw["started_with"] = {"cuda_visible_devices": visible, "gpu_resource": gpu_resource}
    return raw


def test_a_newcomer_serving_a_card_of_the_lost_model_takes_the_gpu_slot_with_its_own_machine(
        monkeypatch: pytest.MonkeyPatch) -> None:
    client = Answers(lambda address: report("c", "1"))
    cluster = joined(client, [("w2", "a"), ("cpu-new", "c"), ("gpu-new", "c")], monkeypatch)
    client.answer = lambda address: report("c", "1" if "gpu" in address else "")
    assert cluster.take_over({"w1"}, set()) == ["w1"]
    taker = cluster.slots[0]
    assert (taker.worker, taker.host, taker.gpu_index) == ("gpu-new", "c", 1)
    assert cluster.worker_of("w1") == "gpu-new"
    assert client.calls == 2  # each newcomer asked once


def test_a_newcomer_that_does_not_answer_is_left_and_asked_again_later(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_module, "PROBE_S", 0.5)
    stopped = threading.Event()
    client = Answers(lambda address: stopped.wait() and report("c", ""))  # a stopped worker: no answer
    cluster = joined(client, [("w1", "a"), ("stuck", "c")], monkeypatch)
    started = time.monotonic()
    assert cluster.take_over({"w2"}, set()) == []
    assert time.monotonic() - started < 3
    assert cluster.take_over({"w2"}, set()) == [] and client.calls == 1  # not asked again at once
    stopped.set()


def test_a_newcomer_started_wrongly_for_a_gpu_is_asked_once_and_said_why(monkeypatch: pytest.MonkeyPatch) -> None:
    client = Answers(lambda address: report("c", None, gpus=2, gpu_resource=1.0))
    cluster = joined(client, [("w1", "a"), ("bad", "c")], monkeypatch)
    for _ in range(20):
        assert cluster.take_over({"w2"}, set()) == []
    assert client.calls == 1
    (note,) = cluster.take_notes()
    assert note.startswith("worker bad joined the cluster but cannot take a lost slot: a worker started with a "
                           "GPU resource sees 2 GPUs")
    assert cluster.take_notes() == []


def test_a_newcomer_on_a_card_another_slot_serves_does_not_take_a_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    # w1 (card 0 of host a) is lost; w3 serves card 1 of host a; a newcomer on host a was
    # started on card 1 too
    client = Answers(lambda address: report("a", "1"))
    cluster = joined(client, [("w2", "a"), ("w3", "a"), ("twin", "a")], monkeypatch)
    cluster.slots.append(replace(slot("w3", "a"), kind="gpu", gpu_index=1))
    cluster._reports["w3"] = machine("a", 2)
    assert cluster.take_over({"w1"}, set()) == []
    assert [(s.host, s.gpu_index) for s in cluster.slots if s.kind == "gpu"] == [("a", 0), ("a", 1)]


def test_a_slot_counts_the_cores_of_the_machine_its_worker_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads per call are divided by the cores of the slot's own machine: 32 on host a (as
    reported), 8 on a newcomer's machine c once it took the slot."""
    small = machine("c", 2)
    small = replace(small, hosts=(replace(small.hosts[0], cores=8),))
    client = Answers(lambda address: {**small.to_dict(), "started_with": {"cuda_visible_devices": "",
                                                                           "gpu_resource": 0.0}})
    cluster = joined(client, [("w1", "a"), ("cpu-new", "c")], monkeypatch)
    assert (cluster.cores_of("w1"), cluster.cores_of("w2")) == (32, 32)
    assert cluster.take_over({"w2"}, set()) == ["w2"]
    assert cluster.cores_of("w2") == 8


def test_a_worker_back_under_its_own_name_elsewhere_is_asked_where_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """w2 restarted under its name on machine c (8 cores): asked once, the slot takes c; one
    still at its old address is not asked; a GPU slot's worker back without a card keeps the
    slot's facts, with a note."""
    small = machine("c", 0)
    small = replace(small, hosts=(replace(small.hosts[0], cores=8),))
    client = Answers(lambda address: {**small.to_dict(), "started_with": {"cuda_visible_devices": "",
                                                                           "gpu_resource": 0.0}})
    cluster = joined(client, [("w1", "a"), ("w2", "c")], monkeypatch)
    cluster.slots = [replace(s, address=f"tcp://a:{s.name}") for s in cluster.slots]  # as first registered
    assert cluster.returned({"w1"}) == [] and client.calls == 0  # w1 at the address it had
    assert cluster.returned({"w2"}) == ["w2"] and client.calls == 1
    assert (cluster.slots[1].host, cluster.cores_of("w2")) == ("c", 8)
    assert cluster.returned({"w2"}) == [] and client.calls == 1  # known at its new address now
    monkeypatch.setattr(cluster_module, "registered_workers",
                        lambda _client: {"tcp://c:w1": {"name": "w1", "host": "c"}})
    assert cluster.returned({"w1"}) == []
    assert cluster.slots[0].host == "a" and cluster.slots[0].gpu_index == 0
    assert "came back as a cpu worker" in cluster.take_notes()[0]
