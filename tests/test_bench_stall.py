"""bench/stall.py: how bench/gpu_ratio.py tells a stalled swarm run from its output as it grows
(issue 63, item 7), and which of the trainer's lines it prints as the cause."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.stall import READY_LINE, STEP_LINE, Stall, last_errors  # noqa: E402


def test_a_run_is_stalled_once_no_step_follows_its_ready_line_within_the_bound(
    tmp_path: Path,
) -> None:
    log = tmp_path / "phase.log"
    log.write_text("importing torch\n")
    watch = Stall(log, bound_s=0.0)  # any wait past the last progress is a stall
    assert watch() == ""  # the servers' start is the timeout's, not the stall's
    with open(log, "a") as f:
        f.write(f"{READY_LINE}: 4 stage servers on cpu\n")
    assert watch() == "stalled: no committed step in 0 s after the stage servers were ready"
    with open(log, "a") as f:
        f.write(f"{STEP_LINE}0 loss 5.5 0.1 s\n{STEP_LINE}1 lo")  # the second not ended yet
    assert watch() == "stalled: no committed step in 0 s after step 0"
    with open(log, "a") as f:
        f.write("ss 5.4 0.1 s\n")
    assert watch() == "stalled: no committed step in 0 s after step 1"
    assert watch.steps == 2


def test_a_run_that_commits_steps_within_the_bound_is_not_stalled(tmp_path: Path) -> None:
    log = tmp_path / "phase.log"
    log.write_text(f"{READY_LINE}: 4 stage servers on cpu\n{STEP_LINE}0 loss 5.5 0.1 s\n")
    watch = Stall(log, bound_s=3600.0)
    assert watch() == "" and watch.ready and watch.steps == 1


def test_the_cause_is_the_trainer_s_last_distinct_warnings_and_errors() -> None:
    repeated = "WARNING client.trainer: t: microbatch 1/0 failed: stage 0: no eligible replica"
    text = "\n".join(
        [
            "2026-11-28 01:11:08,001 INFO swarm.rpc.hop: all well",
            f"2026-11-28 01:11:08,100 {repeated}",
            "2026-11-28 01:11:08,200 WARNING scheduler: replica 127.0.0.1:1 is unreachable",
            f"2026-11-28 01:11:09,100 {repeated}",  # the same line again: kept once, as last
            "swarm stage-server: error: --device cuda:0: CUDA is not available",
            "STEP 0 loss 5.5 0.1 s",
        ]
    )
    assert last_errors(text) == [
        "2026-11-28 01:11:08,200 WARNING scheduler: replica 127.0.0.1:1 is unreachable",
        f"2026-11-28 01:11:09,100 {repeated}",
        "swarm stage-server: error: --device cuda:0: CUDA is not available",
    ]
    assert last_errors(text, 1) == [
        "swarm stage-server: error: --device cuda:0: CUDA is not available"
    ]
    assert last_errors("STEP 0 loss 5.5 0.1 s\n") == []
