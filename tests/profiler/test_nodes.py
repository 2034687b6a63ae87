

def test_gpu_memory_peak_and_headroom_are_kept_and_shown() -> None:
    from flowrl.profiler.nodes import NodeProfile
    from flowrl.records import NodeTiming

    profile = NodeProfile(alpha=0.5)
    profile.observe([NodeTiming("gen", "generate", "gpu-0", 1.0, 1.0, 0.0, 10, 100, 30.0, 110.0)])
    profile.observe([NodeTiming("gen", "generate", "gpu-0", 1.0, 1.0, 0.0, 10, 100, 50.0, 90.0)])
    item = profile.summary()["gen"]
    assert (item.peak_memory_gb, item.memory_headroom_gb) == (50.0, 90.0)
    assert "gpu mem peak 50.0 GB, headroom 90.0 GB" in profile.status_line(2, {"gen": "gen"})
    cpu_only = NodeProfile(alpha=0.5)
    cpu_only.observe([NodeTiming("gen", "generate", "cpu-0", 1.0, 1.0, 0.0, 10, 100)])
    assert "gpu mem" not in cpu_only.status_line(1, {"gen": "gen"})
