"""RatedLog: one line per key per interval, the held-back count on the next line, bounded keys."""

from __future__ import annotations

import logging

import pytest

from swarm.ops.rated import RatedLog


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_one_line_per_key_per_interval_and_the_held_count(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    rated = RatedLog(logging.getLogger("rated-test"), every_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="rated-test"):
        assert rated.warning("auth", "refused %s", "a")
        for i in range(5):
            clock.now = 1.0 + i
            assert not rated.warning("auth", "refused %s", i)
        assert rated.warning("other", "refused other")  # another key is not held back
        clock.now = 10.5
        assert rated.warning("auth", "refused %s", "b")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "refused a",
        "refused other",
        "refused b (and 5 more like it in the last 10 s)",
    ]


def test_keys_are_bounded() -> None:
    clock = Clock()
    rated = RatedLog(logging.getLogger("rated-test"), every_s=10.0, clock=clock)
    for i in range(5000):
        rated.warning(("peer", i), "x")
    assert len(rated._last) <= 1024 and len(rated._held) <= 1024
