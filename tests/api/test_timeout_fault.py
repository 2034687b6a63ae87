"""Which workers a call past its deadline, or a failed collective, blames."""

from __future__ import annotations

from flowrl.api.driver import PEER_LOSS_NOTICE_S, timeout_fault
from flowrl.errors import NodeTimeout


class _Scheduler:
    """What the scheduler answers when asked which of some slots' workers are gone."""

    def __init__(self, gone: list[str]) -> None:
        self.gone = gone
        self.asked: list[tuple[set[str], float]] = []

    def lost_within(self, slots: set[str], wait_s: float) -> list[str]:
        self.asked.append((slots, wait_s))
        return sorted(slot for slot in slots if slot in self.gone)


def test_a_rank_that_died_in_a_collective_is_lost_and_its_peers_keep_their_workers() -> None:
    # a data-parallel rank killed mid-update: the other's all-reduce failed with "Connection
    # reset by peer" before the scheduler saw the death; it was called "cpu-0, cpu-1 hung"
    # and both workers were restarted
    error = NodeTimeout("node 'train' on cpu-0, cpu-1: a collective of its group failed", ("cpu-0", "cpu-1"),
                        collective=True)
    scheduler = _Scheduler(gone=["cpu-1"])
    fault = timeout_fault(error, "detail", scheduler.lost_within)
    assert (fault.kind, fault.slots) == ("lost", ("cpu-1",))
    assert scheduler.asked == [({"cpu-0", "cpu-1"}, PEER_LOSS_NOTICE_S)]


def test_a_gpu_group_whose_rank_died_restarts_every_rank() -> None:
    # an NCCL communicator torn down after a peer died may hang: the survivors restart too
    error = NodeTimeout("a collective of its group failed", ("gpu-0", "gpu-1"), collective=True)
    scheduler = _Scheduler(gone=["gpu-1"])
    fault = timeout_fault(error, "detail", scheduler.lost_within)
    assert (fault.kind, fault.slots) == ("hung", ("gpu-0", "gpu-1")) and scheduler.asked == []


def test_a_collective_whose_peer_stopped_answering_counts_the_group_hung() -> None:
    error = NodeTimeout("a collective of its group failed", ("cpu-0", "cpu-1"), collective=True)
    fault = timeout_fault(error, "detail", _Scheduler(gone=[]).lost_within)
    assert (fault.kind, fault.slots) == ("hung", ("cpu-0", "cpu-1"))


def test_a_call_past_its_deadline_is_hung_without_asking_the_scheduler() -> None:
    scheduler = _Scheduler(gone=["cpu-0"])
    fault = timeout_fault(NodeTimeout("did not finish within 5 s", ("cpu-0",), "reward"), "d", scheduler.lost_within)
    assert (fault.kind, fault.slots) == ("hung", ("cpu-0",)) and scheduler.asked == []
