"""A run measures a CPU slot's overheads on that slot's worker, not in the driver."""

from __future__ import annotations

import pytest


@pytest.mark.integration
def test_a_cpu_workers_overheads_are_measured_on_it() -> None:
    from flowrl.planner.cost import CPU_OVERHEADS
    from flowrl.planner.overhead_probe import PROBE_ROWS, PROBE_TOKENS
    from flowrl.runtime.cluster import Cluster

    cluster = Cluster.start_local(num_slots=1)
    try:
        measured = cluster.cpu_overheads()
        assert measured is not None
        slot, overheads = measured
        assert slot == cluster.slots[0].name
        # a layer at the probe's few rows: its own part and its tokens' (which of the two a
        # busy machine's timings give more of varies; their sum does not)
        tokens = PROBE_ROWS[0] * PROBE_TOKENS
        forward = overheads.forward_layer_s + tokens * overheads.forward_token_s
        train = overheads.train_layer_s + tokens * overheads.train_token_s
        assert 0 < forward < train and overheads != CPU_OVERHEADS
    finally:
        cluster.close()
