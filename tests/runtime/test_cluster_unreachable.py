"""Joining a scheduler that cannot answer: said without waiting Dask's connection timeout."""

from __future__ import annotations

import socket
import threading

import pytest

from flowrl.errors import ClusterError
from flowrl.runtime.cluster import Cluster, _unreachable


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_refused_port_and_an_unknown_host_are_found_before_dask_tries() -> None:
    port = _closed_port()
    assert _unreachable(f"tcp://127.0.0.1:{port}", wait_s=0) == \
        f"nothing listens on port {port} of 127.0.0.1 (connection refused)"
    assert _unreachable("tcp://nosuchhost.invalid:8786", wait_s=0) == "the host name 'nosuchhost.invalid' is not known"
    # a port that accepts: Dask's own connection decides what answers there
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert _unreachable(f"tcp://127.0.0.1:{server.getsockname()[1]}", wait_s=0) is None
    # addresses this probe does not read are left to Dask
    assert _unreachable("inproc://somewhere") is None and _unreachable("127.0.0.1") is None


def test_a_scheduler_that_opens_its_port_while_the_probe_waits_is_joined() -> None:
    """`dask scheduler & flowrl run ...`: the port refuses for a moment, then opens."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    port = server.getsockname()[1]
    opened = threading.Timer(1.0, server.listen)
    opened.start()
    try:
        assert _unreachable(f"tcp://127.0.0.1:{port}", wait_s=10) is None
    finally:
        opened.join()
        server.close()


def test_joining_a_refused_port_fails_with_the_reason() -> None:
    port = _closed_port()
    # (without the probe, Dask retries for the whole timeout and then says it timed out)
    with pytest.raises(ClusterError, match=rf"cannot reach the Dask scheduler at tcp://127.0.0.1:{port}: nothing "
                                           r"listens on port .*Check the address"):
        Cluster.join(f"tcp://127.0.0.1:{port}", timeout_s=2)
