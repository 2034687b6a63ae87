"""How often ``snapshot_every: null`` snapshots: from the trained size and the step time."""

from flowrl.api.driver import snapshot_every_for, snapshot_interval_s


def test_small_models_snapshot_every_ten_seconds_of_steps() -> None:
    assert snapshot_interval_s(7_000_000) == 10.0  # 98 MB (14 bytes each) at 10 MB/s would be 9.8 s
    assert snapshot_every_for(10.0, 0.1) == 100    # the quick start's 0.1 s steps
    assert snapshot_every_for(10.0, 0.7) == 14     # 10 / 0.7 = 14.3
    assert snapshot_every_for(10.0, 30.0) == 1     # a step longer than the interval: every step


def test_larger_models_snapshot_less_often_to_move_at_most_ten_megabytes_a_second() -> None:
    assert snapshot_interval_s(50_000_000) == 70.0  # 700 MB (14 bytes each) / 10 MB/s
    assert snapshot_every_for(70.0, 0.5) == 140
