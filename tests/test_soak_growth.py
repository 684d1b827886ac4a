"""bench/soak.py's growth judgment on canned samples (`span_growth`): threads are judged less
the bounded pools' (the event loop's default executor, gRPC's), which grow as a process gets
busier, and a spill file's idle timer (`own_threads`, read in this process); a peer's stretch
standing by and its stretch serving are judged apart; and growth of any other thread, within
either stretch, still fails the soak."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch

from stage_server.averaging.spill import Spill, SpillFile
from tests.support.waiting import wait_until_blocking

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import soak

WARM, WINDOW = 144.0, 72.0  # a 12-minute run's (--warmup 0.2, --window 0.1)


def _samples(
    threads: list[tuple[float, int]],
    pooled: list[tuple[float, int]] | None = None,
    until: float = 720.0,
) -> list[soak.Sample]:
    """A sample every 3 s to `until`: RSS and descriptors flat, the thread count the last of
    `threads` ((from t, count)) begun by then, of which the last of `pooled` (none by default)
    are the bounded pools'."""
    out: list[soak.Sample] = []
    for i in range(int(until // 3)):
        t = 3.0 * i
        count = [n for since, n in threads if since <= t][-1]
        pool = [n for since, n in pooled or [(0.0, 0)] if since <= t][-1]
        out.append((t, 350.0, 28, count, 18, count - pool))
    return out


def _threads(
    samples: list[soak.Sample], spans: list[tuple[float, float]], key: str = "own"
) -> float:
    return soak.span_growth(samples, spans, WARM, WARM, WINDOW)[key][0]


def test_a_pool_that_grows_as_its_process_gets_busier_is_no_leak() -> None:
    # main's soak at 09:35: peer0 served stage 2 from 6 s with little routed to it (13 threads,
    # its loop's default executor at 2 workers); from 400 s, busier, the executor grew to 6
    # (17 threads), and stayed. All threads: 1.304, failed; less the pools': 1.0.
    samples = _samples(
        [(0.0, 11), (24.0, 13), (400.0, 16), (420.0, 17)],
        [(0.0, 1), (24.0, 2), (400.0, 5), (420.0, 6)],
    )
    assert _threads(samples, [(6.0, math.inf)], "threads") > soak.GROWTH_LIMIT
    assert _threads(samples, [(6.0, math.inf)]) == 1.0


def test_threads_outside_the_pools_that_keep_growing_still_fail() -> None:
    # A thread more every 40 s beside a pool grown to its bound: a leak.
    leak = [(24.0 + 40 * i, 13 + i) for i in range(18)]
    samples = _samples([(0.0, 11), *leak], [(0.0, 1), (24.0, 6)])
    assert _threads(samples, [(6.0, math.inf)]) > soak.GROWTH_LIMIT


def test_a_standby_promoted_is_judged_from_its_promotion() -> None:
    # A replica made standby at 30 s serves nothing (12 threads of its own); promoted at
    # 361 s it averages again: its staging thread and its spill file's idle timer (14). Judged
    # as one stretch from its first serving, that read 1.167 and failed; each stretch on its
    # own grew nothing.
    samples = _samples([(0.0, 11), (24.0, 12), (361.0, 14)])
    assert _threads(samples, [(24.0, math.inf)]) > soak.GROWTH_LIMIT  # judged as one stretch
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


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="threads are read in /proc")
def test_a_spill_files_idle_timer_is_not_judged_a_processs_own(tmp_path: Path) -> None:
    # The 6-minute soak's peer2: a second replica joined its stage, so it began averaging and
    # its spill file's idle timer came for part of each step, 8 -> 8.9 threads (1.115): no leak.
    pid = os.getpid()

    def pooled() -> int:
        threads = len(list(Path(f"/proc/{pid}/task").iterdir()))
        return threads - soak.own_threads(pid, threads)

    before = pooled()
    file = SpillFile(idle_s=3600.0)
    spill = Spill(torch.randn(64), tmp_path, file)
    spill.keep(slice(0, 64))
    spill.close()  # the file given back: its idle timer runs
    try:
        wait_until_blocking(
            lambda: pooled() == before + 1, "the idle timer counted as pooled", timeout_s=30.0
        )
    finally:
        file.close()
