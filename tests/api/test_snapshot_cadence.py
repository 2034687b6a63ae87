"""How often ``snapshot_every: null`` snapshots: from the trained size and the step time."""

from flowrl.api.driver import snapshot_every_for, snapshot_interval_s


def test_small_models_snapshot_every_ten_seconds_of_steps() -> None:
    assert snapshot_interval_s(8_000_000) == 10.0  # 96 MB at 10 MB/s would be 9.6 s
    assert snapshot_every_for(10.0, 0.1) == 100    # the quick start's 0.1 s steps
    assert snapshot_every_for(10.0, 0.7) == 14     # 10 / 0.7 = 14.3
    assert snapshot_every_for(10.0, 30.0) == 1     # a step longer than the interval: every step


def test_larger_models_snapshot_less_often_to_move_at_most_ten_megabytes_a_second() -> None:
    assert snapshot_interval_s(50_000_000) == 60.0  # 600 MB / 10 MB/s
    assert snapshot_every_for(60.0, 0.5) == 120
