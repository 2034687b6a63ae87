"""A run measures a CPU slot's overheads on that slot's worker, not in the driver."""

from __future__ import annotations

import pytest


@pytest.mark.integration
def test_a_cpu_workers_overheads_are_measured_on_it() -> None:
    from flowrl.runtime.cluster import Cluster

    cluster = Cluster.start_local(num_slots=1)
    try:
        measured = cluster.cpu_overheads()
        assert measured is not None
        slot, overheads = measured
        assert slot == cluster.slots[0].name
        assert overheads.forward_layer_s > 0 and overheads.train_layer_s > overheads.forward_layer_s
    finally:
        cluster.close()
