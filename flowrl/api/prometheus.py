"""``/metrics`` for Prometheus while a run goes (``runtime.prometheus_port``).

Served by ``prometheus_client``'s HTTP server from the driver, on its own registry (so two
runs in one process never share series). What a scrape sees, updated after every step:

- ``flowrl_step`` (the last step done), ``flowrl_step_seconds``, ``flowrl_reward_mean``;
- per node (label ``node``): ``flowrl_node_seconds`` (compute time of the step's call, the
  slowest part for a split node) and ``flowrl_node_tokens_per_second`` (summed over parts);
- per device slot (label ``device``): ``flowrl_device_utilization`` (0..1) and
  ``flowrl_device_memory_gigabytes``;
- ``flowrl_metric`` (label ``name``): every number of the step's line in ``metrics.jsonl``
  under its name there (``actor/pg_loss``, ``actor/kl_loss``, ``actor/entropy``,
  ``actor/grad_norm``, ``actor/lr``, ``response_length/mean``, ...), NaN and inf as they are;
- counters ``flowrl_faults_total`` and ``flowrl_moves_total`` (nodes re-placed).
"""

from __future__ import annotations

import socket
from typing import Any

from flowrl.errors import FlowrlError
from flowrl.records import RunEvent, StepRecord

REWARD_KEY = "critic/score/mean"
"""The reward the live view and the report show: the mean score of the step's samples."""


class PrometheusMetrics:
    def __init__(self, port: int, address: str = "0.0.0.0") -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

        probe = socket.socket()
        try:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((address, port))
        except OSError as error:
            raise FlowrlError(f"runtime.prometheus_port: cannot serve /metrics on port {port} ({error.strerror}); "
                              "choose a free port") from error
        finally:
            probe.close()
        self.registry = registry = CollectorRegistry()
        self.step = Gauge("flowrl_step", "Last step done", registry=registry)
        self.step_seconds = Gauge("flowrl_step_seconds", "Wall time of the last step", registry=registry)
        self.reward = Gauge("flowrl_reward_mean", "Mean reward of the last step", registry=registry)
        self.node_seconds = Gauge("flowrl_node_seconds", "Compute seconds of the node's last call",
                                  ["node"], registry=registry)
        self.node_tokens = Gauge("flowrl_node_tokens_per_second", "Tokens per second of the node's last call",
                                 ["node"], registry=registry)
        self.utilization = Gauge("flowrl_device_utilization", "Busy fraction of the device slot (0..1)",
                                 ["device"], registry=registry)
        self.memory = Gauge("flowrl_device_memory_gigabytes", "Memory in use on the device slot",
                            ["device"], registry=registry)
        self.metric = Gauge("flowrl_metric", "A number of the last step's metrics.jsonl line, by its name there",
                            ["name"], registry=registry)
        self.faults = Counter("flowrl_faults", "Faults recovered from", registry=registry)
        self.moves = Counter("flowrl_moves", "Nodes moved to other devices", registry=registry)
        self.server: Any
        try:
            self.server, self.thread = start_http_server(port, addr=address, registry=registry)
        except OSError as error:  # taken between the probe and now
            raise FlowrlError(f"runtime.prometheus_port: cannot serve /metrics on port {port} ({error.strerror}); "
                              "choose a free port") from error
        self.port = port

    def on_step(self, record: StepRecord) -> None:
        self.step.set(record.step)
        if "timing_s/step" in record.metrics:
            self.step_seconds.set(record.metrics["timing_s/step"])
        if REWARD_KEY in record.metrics:
            self.reward.set(record.metrics[REWARD_KEY])
        seconds: dict[str, float] = {}
        tokens: dict[str, float] = {}
        for timing in record.nodes:
            seconds[timing.node] = max(seconds.get(timing.node, 0.0), timing.compute_s)
            tokens[timing.node] = tokens.get(timing.node, 0.0) + timing.tokens_per_s
        for node, value in seconds.items():
            self.node_seconds.labels(node=node).set(value)
            self.node_tokens.labels(node=node).set(tokens[node])
        for name, number in record.metrics.items():  # a NaN loss shows as NaN, not as the last good one
            self.metric.labels(name=name).set(number)
        for sample in record.devices:
            self.utilization.labels(device=sample.device).set(sample.utilization)
            self.memory.labels(device=sample.device).set(sample.memory_gb)

    def on_event(self, event: RunEvent) -> None:
        if event.kind == "fault":
            self.faults.inc()
        elif event.kind == "move":
            self.moves.inc()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
