"""Per-step metrics from node reports, named as verl names them where it has a name."""

from __future__ import annotations

from flowrl.graph import PipelineGraph
from flowrl.records import NodeTiming
from flowrl.runtime.calls import NodeReport

TIMING_NAMES = {
    "generate": "gen",
    "score": "reward",
    "reference_logprob": "ref",
    "value": "values",
    "advantage": "adv",
}


def timing_name(graph: PipelineGraph, node: str) -> str:
    spec = graph.spec.nodes[node]
    if spec.role == "update":
        kind = graph.spec.models[spec.model].kind if spec.model else "policy"
        return "update_actor" if kind == "policy" else "update_critic"
    return TIMING_NAMES.get(spec.role, spec.role)


def step_metrics(
    graph: PipelineGraph, reports: dict[str, NodeReport], step_s: float, num_devices: int
) -> tuple[dict[str, float], list[NodeTiming]]:
    metrics: dict[str, float] = {}
    nodes: list[NodeTiming] = []
    generated_tokens = 0
    for name, report in reports.items():
        for key, value in report.metrics.items():
            metrics[key] = value
        parts = (report, *report.shards)
        key = f"timing_s/{timing_name(graph, name)}"
        # a node split over devices takes as long as its slowest part
        metrics[key] = metrics.get(key, 0.0) + max(part.compute_s for part in parts)
        if report.role == "generate":
            generated_tokens += sum(part.tokens_in + part.tokens_out for part in parts)
        for part in parts:
            nodes.append(
                NodeTiming(
                    name,
                    part.role,
                    part.device,
                    part.wall_s,
                    part.compute_s,
                    part.wait_s,
                    part.tokens_in,
                    part.tokens_out,
                    part.peak_memory_gb,
                    part.device_memory_gb - part.peak_memory_gb if part.device_memory_gb else 0.0,
                )
            )
    peaks = [timing for timing in nodes if timing.peak_memory_gb > 0]
    if peaks:
        # verl's name; the headroom is the tightest device's
        metrics["perf/max_memory_allocated_gb"] = max(t.peak_memory_gb for t in peaks)
        metrics["perf/memory_headroom_gb"] = min(t.memory_headroom_gb for t in peaks)
    metrics["timing_s/step"] = step_s
    # verl's perf/throughput: prompt + response tokens per second per device.
    metrics["perf/throughput"] = generated_tokens / step_s / max(1, num_devices)
    metrics["perf/total_tokens"] = float(generated_tokens)
    return metrics, nodes
