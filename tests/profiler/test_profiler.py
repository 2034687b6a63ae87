"""Smoothing, the status line and the device sampler."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from flowrl.profiler import DeviceSampler, Ewma, NodeProfile, alpha_for_window
from flowrl.records import NodeTiming


def test_the_window_sets_the_weight_of_the_newest_sample() -> None:
    assert alpha_for_window(1) == 1.0
    assert alpha_for_window(9) == pytest.approx(0.2)
    with pytest.raises(ValueError):
        alpha_for_window(0)
    average = Ewma(0.2)
    assert average.update(10.0) == 10.0  # the first sample is taken as it is
    assert average.update(20.0) == pytest.approx(12.0)


def timing(node: str, role: str, device: str, compute_s: float, tokens_out: int = 0) -> NodeTiming:
    return NodeTiming(node, role, device, compute_s + 0.001, compute_s, 0.001, 100, tokens_out,
                      rate_of_output=role == "generate")


def test_status_line_shows_smoothed_times_and_their_change_since_the_last_line() -> None:
    profile = NodeProfile(alpha=0.5)
    labels = {"rollout": "gen", "ref": "ref"}
    profile.observe([timing("rollout", "generate", "cpu-0", 0.080, 800), timing("ref", "reference_logprob", "cpu-1", 0.040)])
    # 800 tokens / 0.08 s
    assert profile.status_line(10, labels) == "[STEP 10] gen 80ms | ref 40ms | gen 10,000 tok/s"
    profile.observe([timing("rollout", "generate", "cpu-0", 0.088, 800), timing("ref", "reference_logprob", "cpu-1", 0.0404)])
    # rollout: 0.08 + 0.5 * 0.008 = 84 ms (+5%); ref 40.2 ms (+0.5%: below 2 %, not shown);
    # tok/s: 10,000 + 0.5 * (9,091 - 10,000) = 9,545 (-5%)
    assert profile.status_line(20, labels) == "[STEP 20] gen 84ms (+5%) | ref 40ms | gen 9,545 tok/s (-5%)"
    summary = profile.summary()["rollout"]
    assert (summary.compute_s, summary.calls, summary.device) == (pytest.approx(0.084), 2, "cpu-0")


def test_a_node_that_moved_starts_its_averages_afresh() -> None:
    profile = NodeProfile(alpha=0.5)
    profile.observe([timing("ref", "reference_logprob", "cpu-1", 0.040)])
    profile.status_line(10, {})
    profile.observe([timing("ref", "reference_logprob", "cpu-0", 0.020)])
    # not 30 ms, and no change shown against a device it no longer runs on
    assert profile.status_line(20, {}) == "[STEP 20] ref 20ms"


def test_tokens_per_s_counts_generated_tokens_for_generate_and_tokens_read_elsewhere() -> None:
    assert NodeTiming("g", "generate", "cpu-0", 1.0, 0.5, 0.5, 300, 100, rate_of_output=True).tokens_per_s == 200.0
    assert NodeTiming("r", "reference_logprob", "cpu-0", 1.0, 0.5, 0.5, 300, 100).tokens_per_s == 600.0


def test_sampler_reports_this_process_and_the_load_of_others_on_its_cores() -> None:
    core = sorted(os.sched_getaffinity(0))[0]
    os.sched_setaffinity(0, {core})
    sampler = DeviceSampler("cpu-0", cores=1, interval_s=0.05)
    try:
        sampler.read()
        spinner = subprocess.Popen(
            ["taskset", "-c", str(core), sys.executable, "-c", "import time\nend = time.time() + 3\nwhile time.time() < end: pass"]
        )
        try:
            sampler.sample()
            spinner.wait()
        finally:
            spinner.kill()
        sample = sampler.read()
    finally:
        sampler.close()
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    assert sample.device == "cpu-0" and sample.kind == "cpu"
    assert sample.memory_gb > 0 and sample.memory_total_gb and sample.memory_total_gb > sample.memory_gb
    # this process only waited, the spinner held the core
    assert sample.utilization < 0.3
    assert sample.external_load is not None and sample.external_load > 0.6


def test_a_node_split_over_devices_is_shown_per_part() -> None:
    profile = NodeProfile(alpha=0.5)
    profile.observe([timing("ref", "reference_logprob", "cpu-1", 0.011), timing("ref", "reference_logprob", "cpu-0", 0.008)])
    assert profile.status_line(10, {"ref": "ref"}) == "[STEP 10] ref@cpu-1 11ms | ref@cpu-0 8.0ms"
    assert set(profile.summary()) == {"ref@cpu-1", "ref@cpu-0"}
    # back on one device: the parts are forgotten
    profile.observe([timing("ref", "reference_logprob", "cpu-0", 0.016)])
    assert profile.status_line(20, {"ref": "ref"}) == "[STEP 20] ref 16ms"
