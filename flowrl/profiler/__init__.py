"""Measuring a run: node calls (timing, tokens) and device samples (utilisation, memory).

The runtime records, the profiler smooths and summarises, the planner and the scheduler
read the smoothed numbers.
"""

from flowrl.profiler.ewma import Ewma, alpha_for_window
from flowrl.profiler.nodes import NodeProfile, NodeSummary
from flowrl.profiler.sampler import DeviceSampler

__all__ = ["DeviceSampler", "Ewma", "NodeProfile", "NodeSummary", "alpha_for_window"]
