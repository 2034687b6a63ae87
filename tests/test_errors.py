"""flowrl's errors go through pickle whole: a run in a process pool, or a worker's error sent
to the driver by Dask, keeps the fields that place and classify it."""

from __future__ import annotations

import pickle

from flowrl.errors import DataError, NodeTimeout, SpecError, SpecIssue, UnmatchedGroups, WorkerLost


def test_errors_with_fields_of_their_own_come_back_from_pickle_with_them() -> None:
    errors = [
        UnmatchedGroups("1 device group cannot be matched:\n  devices.g: g needs 1 gpu", [("devices.g", "g needs 1 gpu")]),
        NodeTimeout("node 'rollout' on cpu-0 did not finish within 5 s", ("cpu-0",), "rollout"),
        WorkerLost("cpu-1 left", ("cpu-1",)),
        DataError("q.jsonl has no split 'test'", "data.split"),
        SpecError([SpecIssue("nodes.rollout.n", "out of range", "p.yaml", 7)]),
    ]
    for error in errors:
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error) and str(back) == str(error) and back.__dict__ == error.__dict__
    assert pickle.loads(pickle.dumps(errors[0])).problems == [("devices.g", "g needs 1 gpu")]
    assert pickle.loads(pickle.dumps(errors[4])).issues[0].line == 7
