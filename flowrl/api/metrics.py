"""Per-step metrics from node reports, named as verl names them where it has a name."""

from __future__ import annotations

from flowrl.graph import PipelineGraph, trained_scores
from flowrl.records import NodeTiming
from flowrl.runtime.calls import NodeReport
from flowrl.spec.schema import GenerateNode, ScoreNode

SUMMED = ("perf/weight_sync_s", "perf/weight_sync_mb")
"""Metrics that several nodes of a step report and that add up."""


def timing_name(graph: PipelineGraph, node: str) -> str:
    spec = graph.spec.nodes[node]
    return spec.timing_name(graph.spec.models[spec.model].kind if spec.model else None)


def status_labels(graph: PipelineGraph) -> dict[str, str]:
    """Each node's name in the status line: its metrics name (``gen``, ``ref``), or its own
    name where several nodes share one (two score nodes are both ``reward``)."""
    names = {node: timing_name(graph, node) for node in graph.topological_order()}
    shared = {name for name in names.values() if list(names.values()).count(name) > 1}
    return {node: node if name in shared else name for node, name in names.items()}


def step_metrics(
    graph: PipelineGraph, reports: dict[str, NodeReport], step_s: float, num_devices: int
) -> tuple[dict[str, float], list[NodeTiming]]:
    metrics: dict[str, float] = {}
    nodes: list[NodeTiming] = []
    generated_tokens = 0
    score_nodes = [name for name in reports if isinstance(graph.spec.nodes[name], ScoreNode)]
    trained = trained_scores(graph.spec)
    for name, report in reports.items():
        # several scores add up, and one that no advantage reads is not in the sum: _summed_scores
        if not (name in score_nodes and (len(score_nodes) > 1 or name not in trained)):
            for key, value in report.metrics.items():
                # several updates (actor and critic) may each push weights: the step's sync is their sum
                metrics[key] = metrics.get(key, 0.0) + value if key in SUMMED else value
        parts = (report, *report.shards)
        key = f"timing_s/{timing_name(graph, name)}"
        # a node split over devices takes as long as its slowest part
        metrics[key] = metrics.get(key, 0.0) + max(part.compute_s for part in parts)
        if isinstance(graph.spec.nodes[name], GenerateNode):
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
                    graph.spec.nodes[name].rate_of_output,
                    part.arrived_at,
                )
            )
    peaks = [timing for timing in nodes if timing.peak_memory_gb > 0]
    if peaks:
        # verl's name; the headroom is the tightest device's
        metrics["perf/max_memory_allocated_gb"] = max(t.peak_memory_gb for t in peaks)
        metrics["perf/memory_headroom_gb"] = min(t.memory_headroom_gb for t in peaks)
    if score_nodes:
        metrics.update(_summed_scores({name: reports[name] for name in score_nodes}, trained))
    metrics["timing_s/step"] = metrics["perf/time_per_step"] = step_s
    # verl's perf/throughput: prompt + response tokens per second per device.
    metrics["perf/throughput"] = generated_tokens / step_s / max(1, num_devices)
    metrics["perf/total_num_tokens"] = float(generated_tokens)
    # verl's timing_per_token_ms: generation per generated token, every other node per
    # prompt + response token of the step.
    for name, report in reports.items():
        parts = (report, *report.shards)
        label = timing_name(graph, name)
        if isinstance(graph.spec.nodes[name], GenerateNode):
            tokens = sum(part.tokens_out for part in parts)
        else:
            tokens = generated_tokens
        seconds = metrics.get(f"timing_s/{label}")  # several score nodes are timed as one sum
        if tokens > 0 and seconds is not None:
            metrics[f"timing_per_token_ms/{label}"] = seconds * 1000.0 / tokens
    return metrics, nodes


def _summed_scores(reports: dict[str, NodeReport], trained: set[str]) -> dict[str, float]:
    """Metrics of the score nodes: the mean of the total the advantages add up (a sum of the
    ``trained`` nodes' means; a node no advantage reads is not in it), each node's own under
    ``reward/<node>/`` (one node's too, so a node's numbers keep their names when a second is
    added), and failures over all of them."""
    metrics: dict[str, float] = {"critic/score/mean": 0.0}
    failed = share_sum = batch_failed = 0.0
    with_failures = 0
    for name, report in reports.items():
        if name in trained:
            metrics["critic/score/mean"] += report.metrics.get("critic/score/mean", 0.0)
        for key, value in report.metrics.items():
            metrics[f"reward/{name}/{key.rsplit('/', 1)[-1]}"] = value
        if "reward/failed_share" in report.metrics:
            failed += report.metrics["reward/num_failed"]
            share_sum += report.metrics["reward/failed_share"]
            batch_failed = max(batch_failed, report.metrics.get("reward/batch_failed", 0.0))
            with_failures += 1
    if with_failures:
        metrics["reward/num_failed"] = failed
        metrics["reward/failed_share"] = share_sum / with_failures
        metrics["reward/batch_failed"] = batch_failed
    return metrics
