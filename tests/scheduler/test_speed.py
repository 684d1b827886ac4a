"""A job's speed in `swarm status`: over a recent window, so it falls to zero in a stall."""

from __future__ import annotations

from scheduler.speed import RecentSpeed


def test_speed_is_over_the_recent_window_and_falls_to_zero_in_a_stall() -> None:
    now = [100.0]
    speed = RecentSpeed(lambda: now[0], window_s=10.0)
    assert speed.rate() == 0.0
    speed.start()  # placement took until t=100
    for _ in range(4):  # a step of 8 samples every second
        now[0] += 1.0
        speed.committed(8)
    assert speed.rate() == 8.0  # over the 4 s since the start, not the whole window
    for _ in range(20):
        now[0] += 1.0
        speed.committed(8)
    assert speed.rate() == 8.0
    now[0] += 5.0  # stalled: the window holds half as many steps
    assert speed.rate() == 4.0
    now[0] += 5.0
    assert speed.rate() == 0.0
