"""Samples one device slot at a fixed interval, from inside its worker.

A daemon thread wakes every ``interval_s`` and records utilisation and memory: NVML for a
GPU slot, psutil for a CPU slot (the worker process's CPU time over the cores it may use,
and its resident set). ``read`` returns the mean utilisation and the peak memory since the
previous read, so a step's sample covers the whole step, not the instant it ended.
"""

from __future__ import annotations

import os
import threading
import time

import psutil

from flowrl.devices.nvml import GpuMeter
from flowrl.records import DeviceSample

MIN_SPAN_S = 0.005
"""Samples closer together than this are skipped: CPU time is counted in ticks."""


class DeviceSampler:
    def __init__(self, device_name: str, cores: int, interval_s: float = 0.5, gpu_index: int | None = None) -> None:
        self.device_name = device_name
        self.interval_s = interval_s
        self._cores = max(1, cores)
        self._process = psutil.Process(os.getpid())
        self._gpu = GpuMeter(gpu_index) if gpu_index is not None else None
        self._lock = threading.Lock()
        self._sampling = threading.Lock()
        self._busy_s = 0.0
        self._span_s = 0.0
        self._peak_gb = 0.0
        self._total_gb = 0.0
        self._core_ids = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        self._last_cpu_s = self._cpu_s()
        self._last_busy_s = self._cores_busy_s()
        self._external_s = 0.0
        self._last_at = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"flowrl-sampler-{device_name}", daemon=True)
        self._thread.start()

    def _cpu_s(self) -> float:
        times = self._process.cpu_times()
        return times.user + times.system

    def _cores_busy_s(self) -> float:
        """CPU seconds spent busy, by any process, on the cores this worker may use."""
        per_cpu = psutil.cpu_times(percpu=True)
        ids = self._core_ids if self._core_ids is not None else range(len(per_cpu))
        busy = 0.0
        for index in ids:
            if index < len(per_cpu):
                times = per_cpu[index]
                busy += sum(times) - times.idle - getattr(times, "iowait", 0.0)
        return busy

    def sample(self) -> None:
        """Take one sample now (the thread calls this every ``interval_s``; ``read`` too)."""
        with self._sampling:  # the thread and a read must not count one span twice
            self._sample()

    def _sample(self) -> None:
        now = time.perf_counter()
        elapsed = now - self._last_at
        if elapsed < MIN_SPAN_S:
            return  # too short to say anything; the next sample covers it
        external = 0.0
        if self._gpu is not None:
            utilization, used_gb, total_gb = self._gpu.read()
        else:
            cpu_s, busy_s = self._cpu_s(), self._cores_busy_s()
            utilization = min(1.0, (cpu_s - self._last_cpu_s) / (elapsed * self._cores))
            # What others ran on these cores: all busy time there minus this worker's own.
            cores = len(self._core_ids) if self._core_ids is not None else (os.cpu_count() or 1)
            others = (busy_s - self._last_busy_s) - (cpu_s - self._last_cpu_s)
            external = min(1.0, max(0.0, others / (elapsed * cores)))
            self._last_cpu_s, self._last_busy_s = cpu_s, busy_s
            used_gb = self._process.memory_info().rss / 1e9
            total_gb = psutil.virtual_memory().total / 1e9
        self._last_at = now
        with self._lock:
            # Weighted by the time each sample covers, so a short one does not count as much.
            self._busy_s += utilization * elapsed
            self._external_s += external * elapsed
            self._span_s += elapsed
            self._peak_gb = max(self._peak_gb, used_gb)
            self._total_gb = total_gb

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def read(self) -> DeviceSample:
        """Mean utilisation and peak memory since the previous read."""
        self.sample()
        with self._lock:
            span = self._span_s
            utilization = self._busy_s / span if span > 0 else 0.0
            external = self._external_s / span if span > 0 else 0.0
            peak, total = self._peak_gb, self._total_gb
            self._busy_s, self._external_s, self._span_s, self._peak_gb = 0.0, 0.0, 0.0, 0.0
        if self._gpu is not None:
            return DeviceSample(self.device_name, "gpu", utilization, peak, total)
        return DeviceSample(self.device_name, "cpu", utilization, peak, total, external)

    def close(self) -> None:
        self._stop.set()
