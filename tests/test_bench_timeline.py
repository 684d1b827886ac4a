"""Where a swarm step's time goes (`swarm.ops.timeline`, `bench/timeline_report.py`): every
process writes its events only when asked, a real worker's calls and a real activation cache's
evictions are written with what the report needs (the call's name and microbatch, the
eviction's cause and bound), and the report cuts a step into what some stage computed and what
none did, the idle time into fill, gaps, drain and commit, adding up to the step."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from bench import spy, timeline_report
from stage_server.replica.activation_cache import ActivationCache
from stage_server.replica.worker import Worker
from swarm.device.activation_bytes import Footprint
from swarm.device.sharing import FixedWindow
from swarm.ops import timeline

pytestmark = pytest.mark.timeout(60)


def forward(step: int, index: int) -> int:
    return step + index


def test_nothing_is_written_unless_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(timeline.ENV, raising=False)
    timeline.mark("open", step=0)
    timeline.span("lease", 0.0, 1.0)
    monkeypatch.setenv(timeline.ENV, str(tmp_path / "lines"))
    timeline.mark("open", step=1)
    events = timeline_report.load(tmp_path / "lines")
    assert [[e["n"], e["step"]] for evs in events.values() for e in evs] == [["open", 1]]


def test_a_worker_s_calls_and_a_cache_s_evictions_are_written_with_their_causes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(timeline.ENV, str(tmp_path / "lines"))
    worker = Worker(ThreadPoolExecutor(1), lambda _: None)
    assert asyncio.run(worker.run(forward, 3, 1)) == 4
    cache, x = ActivationCache(), torch.zeros(256)  # 1 KiB a microbatch
    for index in range(3):
        cache.keep((3, index, "h"), x, x, Footprint(), 2, FixedWindow(1 << 20))
    assert cache.take((3, 0, "h")) is None  # evicted: its Backward recomputes
    assert cache.take((3, 1, "h")) is not None
    events = [e for evs in timeline_report.load(tmp_path / "lines").values() for e in evs]
    call = next(e for e in events if e["n"] == "compute")
    assert call["fn"] == "forward" and call["at"] == [3, 1]
    assert call["q"] <= call["t0"] <= call["t1"] <= call["t2"]
    keeps = [e for e in events if e["n"] == "keep"]
    assert [k["evicted"] for k in keeps] == [[], [], [[3, 0, "h", "count"]]]
    assert keeps[-1]["bound"] == 1 << 20 and keeps[-1]["entries"] == 2
    assert [e["at"] for e in events if e["n"] == "recompute"] == [[3, 0, "h"]]


def test_a_step_is_cut_into_computing_and_idle_and_the_idle_into_where_it_falls() -> None:
    trainer, s0, s1 = 10, 20, 21
    roles = {trainer: "trainer", s0: "stage 0", s1: "stage 1"}

    def compute(t0: float, t1: float, fn: str, at: list[int] | None) -> dict:
        return {"n": "compute", "t0": t0, "t1": t1, "t2": t1 + 0.01, "q": t0, "fn": fn, "at": at}

    events = {
        trainer: [
            {"n": "open", "t0": 0.0, "step": 1},
            {"n": "commit", "t0": 0.8, "step": 1},
            {"n": "applied", "t0": 1.0, "step": 1},
        ],
        s0: [
            compute(0.1, 0.3, "forward", [1, 0]),
            compute(0.6, 0.7, "backward", [1, 0]),
            compute(0.85, 0.9, "_apply", None),
            {
                "n": "keep",
                "t0": 0.3,
                "at": [1, 0],
                "nbytes": 8,
                "held": 0,
                "bound": 4,
                "share": 4,
                "entries": 0,
                "evicted": [[1, 0, "h", "bytes"]],
            },
        ],
        s1: [
            compute(0.25, 0.5, "forward_backward", [1, 0]),
            {"n": "recompute", "t0": 0.6, "at": [1, 0]},
        ],
    }
    report = timeline_report.breakdown(events, roles, [1], [(0.5, 40), (2.0, 100)])
    (row,) = report["steps"]
    assert row["wall"] == pytest.approx(1.0)
    assert row["busy"] == pytest.approx(0.4 + 0.1 + 0.05)  # 0.1-0.5, 0.6-0.7, 0.85-0.9
    assert row["fill"] == pytest.approx(0.1) and row["drain"] == pytest.approx(0.1)
    assert row["gaps"] == pytest.approx(0.1) and row["commit"] == pytest.approx(0.2)
    assert row["commit_idle"] == pytest.approx(0.15) and row["overlap"] == pytest.approx(0.05)
    assert row["idle"] == pytest.approx(row["fill"] + row["gaps"] + row["drain"] + 0.15)
    assert row["recomputes"] == 1 and row["evicted"] == 1 and row["nvml_busy"] == 40
    assert report["evictions"]["by_cause"] == {"stage 0: bytes": 1}
    text = timeline_report.markdown(report)
    assert "| 1 | 1.000 | 0.550 | 0.450 |" in text and "stage 0: bytes" in text
    trace = timeline_report.chrome_trace(events, roles)
    json.dumps(trace)  # Perfetto reads it as JSON
    assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {s0, s1}


def test_py_spy_s_stacks_are_told_by_thread_waiting_apart(tmp_path: Path) -> None:
    raw = tmp_path / "stage.txt"
    raw.write_text(
        "thread (1): MainThread;run (asyncio/runners.py:1);EpollSelector.select (sel.py:1) 9\n"
        "thread (1): MainThread;run (asyncio/runners.py:1);Handing.take (handing.py:9) 1\n"
        "thread (2): stage_0;_worker (concurrent/futures/thread.py:81) 5\n"
        "thread (2): stage_0;Worker._throttled (worker.py:1);CudaClock.settle (clock.py:1) 5\n"
    )
    lines = spy.summary("stage 0", raw)
    assert "  MainThread: 10 samples, 90% waiting" in lines
    assert "     10.0% Handing.take (handing.py:9)" in lines
    assert "  stage_0: 10 samples, 50% waiting" in lines
    assert spy.summary("stage 1", tmp_path / "none.txt")[0].startswith("stage 1: no samples")


def test_a_steps_wait_for_its_last_audits_is_from_the_last_push_answered() -> None:
    """The push plane's audits (issue 69): each starts as its push answered; the step waited
    from the last answer to its last microbatch's end, whichever audit ended last."""
    trainer = 10
    events = {
        trainer: [
            {"n": "open", "t0": 0.0, "step": 1},
            {"n": "audit", "t0": 0.5, "t1": 0.9, "at": [1, 0], "runs": 2},  # ends last
            {"n": "microbatch", "t0": 0.0, "t1": 0.9, "at": [1, 0]},
            {"n": "audit", "t0": 0.7, "t1": 0.72, "at": [1, 1], "runs": 0},  # answered last
            {"n": "microbatch", "t0": 0.0, "t1": 0.72, "at": [1, 1]},
            {"n": "commit", "t0": 0.9, "step": 1},
            {"n": "applied", "t0": 1.0, "step": 1},
        ]
    }
    report = timeline_report.breakdown(events, {trainer: "trainer"}, [1])
    (row,) = report["steps"]
    assert row["audit_wait"] == pytest.approx(0.2) and row["reexecutions"] == 2
    assert "audit wait" in timeline_report.markdown(report)


def test_a_step_opened_before_the_one_before_ended_counts_from_that_end() -> None:
    """The synchronous rule opens step t+1 once step t is decided, before its APPLYs answered:
    the coordinator's record counts step t+1's seconds from step t's end, and so does the
    report (tests/system/test_gpu_ratio.py holds the two together). Before, the report counted
    from the opening: 17 ms longer than the record in a full run."""
    trainer, s0 = 10, 20
    compute = {"n": "compute", "t0": 0.95, "t1": 1.5, "fn": "forward", "at": [2, 0]}
    events = {
        trainer: [
            {"n": "open", "t0": 0.0, "step": 1},
            {"n": "commit", "t0": 0.8, "step": 1},
            {"n": "open", "t0": 0.9, "step": 2},  # decided: step 1's APPLYs are on their way
            {"n": "applied", "t0": 1.0, "step": 1},
            {"n": "commit", "t0": 1.6, "step": 2},
            {"n": "applied", "t0": 1.7, "step": 2},
        ],
        s0: [compute],
    }
    steps = timeline_report.breakdown(events, {trainer: "trainer", s0: "stage 0"}, [1, 2], [])
    row = steps["steps"][1]
    assert row["step"] == 2 and row["wall"] == pytest.approx(0.7)  # 1.0 to 1.7, as recorded
    assert row["fill"] == pytest.approx(0.0) and row["busy"] == pytest.approx(0.5)
    assert row["idle"] == pytest.approx(row["fill"] + row["gaps"] + row["drain"] + 0.1)
