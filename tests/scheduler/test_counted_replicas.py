"""A replica counts (in `swarm status`, the single-replica warning, the scheduler's gauges) only
once its join succeeded: a spare placed in a running job shows as joining, with what it waits
for, until the coordinator admits it; one nobody can reach never counts (issue 45, item 2)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

import stage_server.agent
from stage_server.replica.runtime import StageRuntime
from swarm.job.states import peer_state_name
from swarm.proto import control_pb2 as cpb
from swarm.proto import scheduler_pb2 as spb
from tests.support.scheduled import AMQTT_LEAKS, LONG_SPEC, WAIT_S, ScheduledSwarm, scheduled_swarm
from tests.support.waiting import wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(180),
    AMQTT_LEAKS,
]


def _slow_build(*args: Any) -> StageRuntime:
    time.sleep(1.0)  # as a real model's stage takes a while to build
    return StageRuntime(*args)


def _rows(s: spb.JobStatus) -> dict[str, tuple[int, str, str]]:
    """peer -> (stage, state, what it waits for)"""
    return {
        r.peer: (st.stage, peer_state_name(r.state), r.joining)
        for st in s.stages
        for r in st.replicas
    }


async def test_a_spare_nobody_can_reach_never_counts(tmp_path: Path) -> None:
    async with scheduled_swarm(tmp_path) as swarm:
        job = await swarm.start_job(LONG_SPEC, tmp_path)
        status = swarm.status(job)
        assert (
            len(status.warnings) == 1 and "stages 0, 1 have a single replica" in status.warnings[0]
        )
        # It listens on 127.0.0.1 and tells others to dial 127.0.0.2: nothing answers there.
        await swarm.add("far", announce_host="127.0.0.2")

        def unreachable() -> bool:
            report = swarm.scheduler.peer_registry.reachability("far")
            return report is not None and report.reachability == cpb.REACHABILITY_UNREACHABLE

        # The scheduler's dial-back finds that out (issue 42): it is never placed, so it never
        # says it serves (it used to be placed, and to show as joining, "not answering").
        await wait_until(
            unreachable, "the scheduler's dial-back finds the spare unreachable", timeout_s=WAIT_S
        )
        assert swarm.scheduler.peer_registry.given(job, "far") is None
        assert swarm.scheduler.peer_registry.peers["far"].state != cpb.PEER_STATE_SERVING
        status = swarm.status(job)
        assert "far" not in _rows(status), _rows(status)
        # Each stage still has a single replica, and says so; and status says why far is not
        # placed, with what fixes it.
        assert [
            len([r for r in st.replicas if r.state == cpb.PEER_STATE_SERVING])
            for st in status.stages
        ] == [1, 1]
        assert len(status.warnings) == 2, status.warnings
        assert "stages 0, 1 have a single replica" in status.warnings[0]
        assert "peer far is UNREACHABLE at 127.0.0.2:" in status.warnings[1]
        assert "--announce-host" in status.warnings[1] and "--relay" in status.warnings[1]
        metrics = _gauges(swarm, job)
        assert metrics[("0", "serving")] == 1 and metrics[("1", "serving")] == 1
        assert ("0", "joining") not in metrics and ("1", "joining") not in metrics


async def test_a_spare_counts_once_it_joined(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with scheduled_swarm(tmp_path) as swarm:
        job = await swarm.start_job(LONG_SPEC, tmp_path)
        monkeypatch.setattr(stage_server.agent, "StageRuntime", _slow_build)
        await swarm.add("c")
        coordinator = swarm.scheduler._coordinators[job]
        seen: list[tuple[int, str, str]] = []

        def admitted() -> bool:
            row = _rows(swarm.status(job)).get("c")
            if row is not None:
                seen.append(row)
                # Shown serving only once the coordinator counts it a member.
                if row[1] == "serving":
                    assert "c" in coordinator.membership.synced
            return "c" in coordinator.membership.synced and row is not None and row[1] == "serving"

        await wait_until(admitted, "the spare joins", timeout_s=WAIT_S)
        # Listed from its placement on, building its stage (a second here), then joining.
        assert seen[0][1:] == ("joining", f"building stage {seen[0][0]} (assigned 0 s ago)"), seen
        assert any(row[2].startswith("downloading state from") for row in seen) or any(
            row[2].startswith("waiting for a step's end") for row in seen
        ), seen
        stage = _rows(swarm.status(job))["c"][0]
        said = [e.text for e in swarm.store.events(job) if e.text.startswith("c counts")]
        assert len(said) == 1 and said[0].startswith(f"c counts as a replica of stage {stage} "), (
            said
        )
        [member] = [
            p for p, row in _rows(swarm.status(job)).items() if row[0] == stage and p != "c"
        ]
        assert said[0].endswith(f"(a copy of {member})"), said
        other = f"stage {1 - stage} has a single replica"
        # The watch looks every second: the warning drops the stage that has a spare now.
        await wait_until(
            lambda: [other in w for w in swarm.status(job).warnings] == [True],
            "the warning names only the stage without a spare",
            timeout_s=WAIT_S,
        )
        assert _gauges(swarm, job)[(str(stage), "serving")] == 2


def _gauges(swarm: ScheduledSwarm, job: str) -> dict[tuple[str, str], float]:
    """swarm_scheduler_peers of `job`: (stage, state) -> peers."""
    from prometheus_client import CollectorRegistry

    from scheduler.collector import collector

    registry = CollectorRegistry()
    registry.register(collector(swarm.scheduler))
    found: dict[tuple[str, str], float] = {}
    for family in registry.collect():
        if family.name == "swarm_scheduler_peers":
            for sample in family.samples:
                if sample.labels["job"] == job:
                    found[(sample.labels["stage"], sample.labels["state"])] = sample.value
    return found


async def test_a_banned_replica_shows_as_banned_not_as_joining(tmp_path: Path) -> None:
    """A peer banned from the job still serves its stage (nothing withdraws it), and counts for
    nothing: status showed it joining, "waiting for a step's end to download state from a
    member", which it never does (a review found it)."""
    async with scheduled_swarm(tmp_path) as swarm:
        job = await swarm.start_job(LONG_SPEC, tmp_path)
        coordinator = swarm.scheduler._coordinators[job]
        banned = next(iter(_rows(swarm.status(job))))
        stage = _rows(swarm.status(job))[banned][0]
        coordinator.membership.synced.discard(banned)  # as a ban leaves it: no member
        coordinator.barred = lambda stages: {stage: [banned]}  # type: ignore[method-assign]
        row = _rows(swarm.status(job))[banned]
        assert row == (stage, "joining", "banned from this job (its history says why)"), row
