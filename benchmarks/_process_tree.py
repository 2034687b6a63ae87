"""Measuring a child process and everything it starts: peak memory, CPU, other load.

Used by ``vs_trl.py`` from the parent process, so the measured runs import nothing of it.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

MEMORY_SAMPLE_S = 0.2
"""Seconds between two memory samples of the process tree."""


class TreeMemorySampler:
    """Peak of the summed RSS / PSS of a process and all its descendants, sampled in a thread.

    Every sample reads each known process's RSS (/proc/PID/statm, cheap); every
    ``REFRESH_EVERY`` samples it looks for new descendants and reads PSS (smaps_rollup), which
    costs more: the sampler shares the machine with what it measures.
    """

    REFRESH_EVERY = 5

    def __init__(self, pid: int, interval_s: float = MEMORY_SAMPLE_S) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.peak_rss = 0
        self.peak_pss = 0
        self.max_processes = 0
        self.num_samples = 0
        self.process_peak_rss: dict[int, int] = {}
        self.process_names: dict[int, str] = {}
        self.load_average_before = os.getloadavg()[0]
        self._system_busy_start_s = _system_busy_s()
        self._own_cpu_start_s = _own_cpu_s()
        self._started = time.perf_counter()
        self._usage: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="memory-sampler", daemon=True)

    def __enter__(self) -> "TreeMemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def finish(self, tree_cpu_s: float) -> None:
        """Note the CPU time of the measured tree (from wait4) against the whole machine's.

        The rest of the machine's busy time went to other processes: other people's work on
        a shared machine, which makes every time measured here longer.
        """
        wall_s = time.perf_counter() - self._started
        system_busy_s = _system_busy_s() - self._system_busy_start_s
        sampler_cpu_s = _own_cpu_s() - self._own_cpu_start_s
        foreign_cpu_s = max(0.0, system_busy_s - tree_cpu_s - sampler_cpu_s)
        self._usage = {
            "tree_cpu_s": tree_cpu_s,
            "sampler_cpu_s": sampler_cpu_s,
            "foreign_cpu_s": foreign_cpu_s,
            "foreign_cpu_share": foreign_cpu_s / max(wall_s * (os.cpu_count() or 1), 1e-9),
        }

    def _loop(self) -> None:
        import psutil

        gone = (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess)
        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        processes = [root]
        while True:
            refresh = self.num_samples % self.REFRESH_EVERY == 0
            if refresh:
                try:
                    processes = [root, *root.children(recursive=True)]
                except psutil.NoSuchProcess:
                    return
            rss = pss = 0
            for process in processes:
                try:
                    info = process.memory_full_info() if refresh else process.memory_info()
                except gone:
                    continue
                rss += info.rss
                pss += getattr(info, "pss", 0)
                self.process_peak_rss[process.pid] = max(self.process_peak_rss.get(process.pid, 0), info.rss)
                if process.pid not in self.process_names:
                    self.process_names[process.pid] = _describe(process, self.pid)
            self.peak_rss = max(self.peak_rss, rss)
            self.peak_pss = max(self.peak_pss, pss)
            self.max_processes = max(self.max_processes, len(processes))
            self.num_samples += 1
            if self._stop.wait(self.interval_s):
                return

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak_rss_mib": self.peak_rss / 2**20,
            "peak_pss_mib": self.peak_pss / 2**20,
            "max_processes": self.max_processes,
            "num_samples": self.num_samples,
            "interval_s": self.interval_s,
            "load_average_1min_before": self.load_average_before,
            **self._usage,
            "per_process_peak_rss_mib": {
                f"{pid} {self.process_names.get(pid, '?')}": peak / 2**20 for pid, peak in self.process_peak_rss.items()
            },
        }


def _system_busy_s() -> float:
    import psutil

    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def _own_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def _describe(process: Any, root_pid: int) -> str:
    """A short role name for a process of the measured tree."""
    try:
        cmdline = " ".join(process.cmdline())
    except Exception:  # the process may be gone; the name is only a label
        return "?"
    if process.pid == root_pid:
        return "runner (driver)"
    if "resource_tracker" in cmdline:
        return "multiprocessing resource tracker"
    if "spawn_main" in cmdline:
        return "spawned worker"
    return cmdline[:60]


def wait_for_quiet(max_wait_s: float, busy_share: float = 0.25) -> float:
    """Wait until the machine's CPUs are mostly idle (at most ``max_wait_s``); seconds waited."""
    import psutil

    started = time.perf_counter()
    while time.perf_counter() - started < max_wait_s:
        if psutil.cpu_percent(interval=1.0) / 100.0 < busy_share:
            break
    return time.perf_counter() - started
