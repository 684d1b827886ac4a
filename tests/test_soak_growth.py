"""bench/soak.py's growth judgment on canned samples (`span_growth`): a peer's stretch standing
by and its stretch serving are judged apart, and growth within either still fails the soak."""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import soak

WARM, WINDOW = 144.0, 72.0  # a 12-minute run's (--warmup 0.2, --window 0.1)


def _samples(threads: list[tuple[float, int]], until: float = 720.0) -> list[soak.Sample]:
    """A sample every 3 s to `until`: RSS and descriptors flat, the thread count the last of
    `threads` ((from t, count)) begun by then."""
    out: list[soak.Sample] = []
    for i in range(int(until // 3)):
        t = 3.0 * i
        count = [n for since, n in threads if since <= t][-1]
        out.append((t, 350.0, 28, count, 18))
    return out


def _threads(samples: list[soak.Sample], spans: list[tuple[float, float]]) -> float:
    return soak.span_growth(samples, spans, WARM, WARM, WINDOW)["threads"][0]


def test_a_standby_promoted_is_judged_from_its_promotion() -> None:
    # main's soak at 09:35: peer0 served at 24 s, stood by from 30 s with 13 threads, was
    # promoted at 361 s and its pools filled (17 threads). Judged from its first serving, as
    # before, that read 1.304 and failed; each stretch on its own grew nothing.
    samples = _samples([(0.0, 11), (24.0, 13), (400.0, 16), (420.0, 17)])
    assert _threads(samples, [(24.0, math.inf)]) > soak.GROWTH_LIMIT  # the old judgment
    spans = [(24.0, 30.0), (30.0, 361.0), (361.0, math.inf)]
    assert _threads(samples, spans) <= soak.GROWTH_LIMIT


def test_threads_that_keep_growing_while_serving_still_fail() -> None:
    # A thread more every 40 s while serving: a leak, whatever stretch it is in.
    samples = _samples([(0.0, 11), *((24.0 + 40 * i, 13 + i) for i in range(18))])
    assert _threads(samples, [(24.0, 30.0), (30.0, 361.0), (361.0, math.inf)]) > 1.1
    assert _threads(samples, [(24.0, math.inf)]) > 1.1


def test_threads_that_keep_growing_while_standing_by_still_fail() -> None:
    samples = _samples([(0.0, 11), *((24.0 + 30 * i, 13 + i) for i in range(12))])
    assert _threads(samples, [(24.0, 30.0), (30.0, 500.0), (500.0, math.inf)]) > 1.1


def test_a_stretch_shorter_than_two_windows_is_not_judged() -> None:
    samples = _samples([(0.0, 11), (24.0, 13), (700.0, 30)])
    assert soak.span_growth(samples, [(24.0, 30.0), (650.0, math.inf)], WARM, WARM, WINDOW) == {}


def test_spans_of_a_peer_follow_its_roles_and_other_processes_their_life() -> None:
    peer = soak.Instance("peer", "peer0", proc=None, started=1.0)  # type: ignore[arg-type]
    assert peer.spans() == []  # never shown serving or standing by: a spare, idle
    for t, role in ((24.0, "serving"), (27.0, "serving"), (30.0, "standby"), (361.0, "serving")):
        peer.shown(t, role)
    assert peer.spans() == [(24.0, 30.0), (30.0, 361.0), (361.0, math.inf)]
    standby = soak.Instance("peer", "peer1", proc=None, started=1.0)  # type: ignore[arg-type]
    standby.shown(5.0, "standby")
    assert standby.spans() == [(5.0, math.inf)]  # a standby's following is judged too
    trainer = soak.Instance("trainer", "t", proc=None, started=2.0)  # type: ignore[arg-type]
    assert trainer.spans() == [(2.0, math.inf)]
