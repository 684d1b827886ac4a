"""Redundancy with real processes (scheduler, stage servers, broker): a stage that loses its last
replica while another stage has a spare gets the spare at once (not at the next rebalancing
check), the scheduler says so, and the job is `stalled` until the stage is served again, then
`running`; `--min-replicas` fills every stage to it before any gets more, and says what is short."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from client.sdk import SchedulerClient
from swarm.job.states import job_state_name
from swarm.local.procs import LocalSwarm, start_local_swarm
from tests.support.cli import swarm
from tests.support.equality import assert_equal_to_local
from tests.support.jobs import write_job
from tests.support.status import job_status
from tests.support.waiting import wait_until_blocking

pytestmark = pytest.mark.slow

PERIOD_S = 3600.0
"""The rebalancing check's period: longer than the test runs, so no periodic check comes while
it runs, and a move it sees can only be the one made at once when a stage lost its last replica
(judged by what happened, not by how many seconds it took on a busy machine)."""


def test_a_lost_stage_gets_a_spare_at_once_and_the_job_is_stalled_meanwhile(
    tmp_path: Path,
) -> None:
    # Five servers for four stages: one stage has a spare. The only replica of another stage is
    # SIGKILLed after step 6 (the checkpoint of step 4 is sealed). 20 steps: the kill lands 14
    # steps before the end, as in test_control_plane's stage-lost tests (30 trained 10 more
    # steps at the throttle, after every claim but the equality was seen).
    job = write_job(
        tmp_path,
        training={"steps": 20, "target_batch_size": 16, "checkpoint_every": 4},
        rebalance={"period_s": PERIOD_S},
    )
    sw, _ = start_local_swarm([20.0] * 5, log_dir=tmp_path)
    try:
        job_id = swarm("submit", str(job), "--scheduler", sw.address).stdout.split()[0]
        status = _wait(sw, job_id, lambda s: s["step"] >= 6 and _spare(s) is not None)
        spare = _spare(status)
        assert spare is not None
        victim_stage, spare_stage = spare
        victim = status["stages"][victim_stage]["replicas"][0]["peer"]
        next(p for p in sw.peers if p.ready["peer"] == victim).kill()
        seen = asyncio.run(_states_until_served(sw.address, job_id, victim_stage))
        # `swarm status` and `swarm jobs` showed the job stalled, then running again.
        assert ("stalled", "stalled") in seen, seen
        assert seen[-1] == ("running", "running"), seen
        doc = _status(sw, job_id)
        events = [(e["time"], e["kind"], e["text"]) for e in doc["events"]]
        stall = next(e for e in events if e[1] == "stall")
        moved = re.fullmatch(
            rf"stage {victim_stage} lost its last replica at step \d+: training stalled; moving "
            rf"(\S+) from stage {spare_stage} \(a spare replica\)",
            stall[2],
        )
        assert moved is not None, events
        states = [text for _, kind, text in events if kind == "state"]
        stalled = next(t for t in states if t.startswith("running -> stalled: "))
        assert f"the scheduler is moving {moved[1]} from stage {spare_stage}" in stalled, states
        assert "start a stage server" not in stalled, states
        assert any(t.startswith("stalled -> running") for t in states), states
        assert re.search(
            rf"job \S+: stage {victim_stage} has no replica: moving {moved[1]} from stage "
            rf"{spare_stage} to it",
            sw.scheduler.log(),
        )
        _wait(sw, job_id, lambda s: s["state"] == "succeeded", timeout=300)
        swarm("export", job_id, "--out", str(tmp_path / "swarm.pt"), "--scheduler", sw.address)
    finally:
        sw.stop()
    assert_equal_to_local(job, torch.load(tmp_path / "swarm.pt"), tol=1e-9)


def test_min_replicas_fills_the_short_stages_first_and_says_what_they_take(
    tmp_path: Path,
) -> None:
    # --min-replicas 2 for a job of 4 stages on 5 servers: the job starts (one replica each at
    # least) and says that 3 more servers would give every stage two; each server that joins
    # goes to a stage short of two, and the warning counts down.
    job = write_job(tmp_path, training={"steps": 400, "target_batch_size": 16})
    sw, _ = start_local_swarm([20.0] * 5, log_dir=tmp_path, extra_scheduler=["--min-replicas", "2"])
    try:
        job_id = swarm("submit", str(job), "--scheduler", sw.address).stdout.split()[0]
        # The warning is the stall watch's, made on its own tick, the replicas live: a look
        # between the fifth server's admission and the next tick shows a stage of two beside a
        # warning of four stages short. What the job says once it has looked again is judged.
        status = _wait(
            sw,
            job_id,
            lambda s: s["step"] >= 1 and "3 more stage server(s)" in str(s.get("warnings")),
        )
        sizes = [len(s.get("replicas", [])) for s in status["stages"]]
        assert sorted(sizes) == [1, 1, 1, 2], sizes
        short = [k for k, n in enumerate(sizes) if n == 1]
        assert status["warnings"][0].startswith(
            f"stages {', '.join(map(str, short))} have fewer than min_replicas = 2 (1, 1, 1): 3 "
            "more stage server(s) would fill every stage; "
        ), status["warnings"]
        sw.add_peer(20.0)
        status = _wait(sw, job_id, lambda s: "2 more stage server(s)" in str(s.get("warnings")))
        now = [len(s.get("replicas", [])) for s in status["stages"]]
        grown = [k for k in range(4) if now[k] > sizes[k]]
        assert len(grown) == 1 and grown[0] in short, (sizes, now)
        swarm("cancel", job_id, "--scheduler", sw.address)
    finally:
        sw.stop()


def _spare(status: dict[str, Any]) -> tuple[int, int] | None:
    """(a stage with a single replica, a stage with two or more), if the job has both."""
    sizes = [len(s.get("replicas", [])) for s in status.get("stages", [])]
    single = [k for k, n in enumerate(sizes) if n == 1]
    spare = [k for k, n in enumerate(sizes) if n >= 2]
    return (single[0], spare[0]) if single and spare else None


def _status(sw: LocalSwarm, job_id: str) -> dict[str, Any]:
    doc = job_status(sw.address, job_id)
    doc["step"] = int(doc.get("step", 0))
    doc["state"] = doc["state"].removeprefix("JOB_STATE_").lower()
    return doc


def _wait(
    sw: LocalSwarm, job_id: str, ok: Callable[[dict[str, Any]], bool], timeout: float = 120.0
) -> dict[str, Any]:
    seen: list[dict[str, Any]] = [{}]

    def there() -> dict[str, Any] | None:
        seen[0] = _status(sw, job_id)
        return seen[0] if ok(seen[0]) else None

    return wait_until_blocking(
        there, lambda: f"job {job_id} there (last seen: {seen[0]})", timeout_s=timeout, every_s=0.3
    )


async def _states_until_served(
    address: str, job_id: str, stage: int, timeout: float = 60.0
) -> list[tuple[str, str]]:
    """(GetJob's state, ListJobs's state) at each look, every 0.1 s, until the job runs again
    with `stage` served."""
    seen: list[tuple[str, str]] = []
    async with SchedulerClient(address) as client:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = await client.get(job_id)
            listed = next(j for j in await client.list() if j.job == job_id)
            look = (job_state_name(status.state), job_state_name(listed.state))
            if not seen or seen[-1] != look:
                seen.append(look)
            if look == ("running", "running") and len(seen) > 1 and status.stages[stage].replicas:
                return seen
            await asyncio.sleep(0.1)
    return seen
