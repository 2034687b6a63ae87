"""Smoothed per-node measurements and the periodic status line.

Every step, each node call's timing goes in; per node the profile keeps an EWMA of its
wall, compute and wait time and of its tokens/s. ``status_line`` compares the averages
with those of the previous status line, so a user sees drift at a glance::

    [STEP 120] gen 82ms (+5%) | ref 40ms | reward 0.9ms | train 61ms (-3%) | gen 142 tok/s (+8%)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from flowrl.profiler.ewma import Ewma
from flowrl.records import NodeTiming

CHANGE_SHOWN = 0.02
"""Relative changes below this (2 %) are not shown in the status line: noise."""


@dataclass(frozen=True)
class NodeSummary:
    """The smoothed numbers of one node."""

    node: str
    role: str
    device: str
    wall_s: float
    compute_s: float
    wait_s: float
    tokens_per_s: float
    calls: int
    peak_memory_gb: float = 0.0
    """The most GPU memory one call held, over the calls seen (0 off a GPU)."""
    memory_headroom_gb: float = 0.0
    """The least memory left free by one call's peak (0 off a GPU)."""
    rate_of_output: bool = False
    """``tokens_per_s`` counts tokens produced (generation), else tokens read."""


@dataclass
class _NodeAverages:
    role: str
    device: str
    wall: Ewma
    compute: Ewma
    wait: Ewma
    rate: Ewma
    calls: int = 0
    peak_memory_gb: float = 0.0
    memory_headroom_gb: float = 0.0
    rate_of_output: bool = False


@dataclass
class NodeProfile:
    """EWMA of every node's measurements over the run (``alpha`` from the window)."""

    alpha: float
    _nodes: dict[tuple[str, str], _NodeAverages] = field(default_factory=dict)
    _shown: dict[str, NodeSummary] = field(default_factory=dict)

    def observe(self, timings: Sequence[NodeTiming]) -> None:
        # Averages are per (node, device): a node split over devices has one per part. A node
        # whose devices changed starts afresh: a move, or a new split (a part's times are
        # not comparable with the whole batch's), makes its old numbers say nothing.
        where: dict[str, set[str]] = {}
        for timing in timings:
            where.setdefault(timing.node, set()).add(timing.device)
        for node, devices in where.items():
            if {device for name, device in self._nodes if name == node} != devices:
                for key in [key for key in self._nodes if key[0] == node]:
                    del self._nodes[key]
        for timing in timings:
            averages = self._nodes.get((timing.node, timing.device))
            if averages is None:
                averages = _NodeAverages(
                    timing.role, timing.device, Ewma(self.alpha), Ewma(self.alpha), Ewma(self.alpha), Ewma(self.alpha),
                    rate_of_output=timing.rate_of_output,
                )
                self._nodes[(timing.node, timing.device)] = averages
            averages.wall.update(timing.wall_s)
            averages.compute.update(timing.compute_s)
            averages.wait.update(timing.wait_s)
            averages.rate.update(timing.tokens_per_s)
            averages.calls += 1
            if timing.peak_memory_gb > 0:
                first = averages.peak_memory_gb == 0
                averages.peak_memory_gb = max(averages.peak_memory_gb, timing.peak_memory_gb)
                averages.memory_headroom_gb = (timing.memory_headroom_gb if first
                                               else min(averages.memory_headroom_gb, timing.memory_headroom_gb))

    def forget(self, node: str) -> None:
        """Drop a node's averages (its work per part changed)."""
        for key in [key for key in self._nodes if key[0] == node]:
            del self._nodes[key]
        for name in [name for name, item in self._shown.items() if item.node == node]:
            del self._shown[name]

    def summary(self) -> dict[str, NodeSummary]:
        """By node; a node split over devices by ``node@device``, one entry per part."""
        parts: dict[str, int] = {}
        for node, _ in self._nodes:
            parts[node] = parts.get(node, 0) + 1
        return {
            (node if parts[node] == 1 else f"{node}@{device}"): NodeSummary(
                node,
                item.role,
                item.device,
                item.wall.value or 0.0,
                item.compute.value or 0.0,
                item.wait.value or 0.0,
                item.rate.value or 0.0,
                item.calls,
                item.peak_memory_gb,
                item.memory_headroom_gb,
                item.rate_of_output,
            )
            for (node, device), item in self._nodes.items()
        }

    def status_line(self, step: int, labels: Mapping[str, str]) -> str:
        """Compute time per node (and generated tokens/s), with the change since the last
        status line; ``labels`` names nodes as the metrics do (``gen``, ``ref``)."""
        now = self.summary()
        parts = []
        rates = []
        for name, item in now.items():
            label = labels.get(item.node, item.node) + name[len(item.node):]
            before = self._shown.get(name)
            if before is not None and before.device != item.device:
                before = None  # moved: a change against another device's time says nothing
            parts.append(f"{label} {_ms(item.compute_s)}{_change(item.compute_s, before.compute_s if before else None)}")
            if item.rate_of_output:
                old_rate = before.tokens_per_s if before else None
                rates.append(f"{label} {item.tokens_per_s:,.0f} tok/s{_change(item.tokens_per_s, old_rate)}")
        self._shown = now
        on_gpu = [item for item in now.values() if item.peak_memory_gb > 0]
        memory = []
        if on_gpu:
            tightest = min(on_gpu, key=lambda item: item.memory_headroom_gb)
            memory.append(f"gpu mem peak {max(item.peak_memory_gb for item in on_gpu):.1f} GB, "
                          f"headroom {tightest.memory_headroom_gb:.1f} GB")
        return f"[STEP {step}] " + " | ".join(parts + rates + memory)


def _ms(seconds: float) -> str:
    milliseconds = seconds * 1e3
    return f"{milliseconds:.1f}ms" if milliseconds < 10 else f"{milliseconds:.0f}ms"


def _change(now: float, before: float | None) -> str:
    if before is None or before <= 0:
        return ""
    change = now / before - 1
    return f" ({change:+.0%})" if abs(change) >= CHANGE_SHOWN else ""
