"""A job waiting for peers says what the stage servers present are doing: the message asked
for more stage servers ("0 more peer(s) measured: start a stage server") where some were still
measuring the job, or were held by another job still placing (a review found it)."""

from __future__ import annotations

import asyncio

from scheduler.assignments import Assignments
from swarm.clock import FakeClock
from swarm.proto import control_pb2 as cpb
from tests.support.placement import placement
from tests.support.waiting import wait_until


def _peer(peer: str, job: str, state: int, **fields: object) -> cpb.PeerAnnouncement:
    return cpb.PeerAnnouncement(
        peer=peer,
        address=f"{peer}:1",
        job=job,
        state=state,  # type: ignore[arg-type]
        role=cpb.PEER_ROLE_STAGE_SERVER,
        incarnation="1",
        **fields,  # type: ignore[arg-type]
    )


async def test_waiting_for_peers_names_those_measuring_and_those_another_job_holds() -> None:
    said: list[str] = []
    registry, assignments = placement(FakeClock(), 60.0, said)
    registry.announce(_peer("m", "", cpb.PEER_STATE_JOINING))  # measuring: no figures yet
    registry.announce(_peer("o1", "other", cpb.PEER_STATE_SERVING, stage=0))
    registry.announce(_peer("o2", "other", cpb.PEER_STATE_JOINING, samples_per_second={0: 1.0}))
    await _placing(assignments, said, 2)
    text = said[0]
    assert text.startswith("waiting for peers: stages 0, 1 without a replica"), text
    assert "; present: 1 free stage server(s) not measured yet (measuring, or about to)" in text
    assert '; 2 stage server(s) held by other jobs (2 by job "other"): a stage server takes' in text


async def test_a_job_id_a_peer_announced_is_quoted_as_its_words() -> None:
    """Any token holder's peer may announce any text as the job it is held by: quoted, it
    cannot pass for the scheduler's words in the job's message."""
    said: list[str] = []
    registry, assignments = placement(FakeClock(), 60.0, said)
    forged = 'x"; left out after 3 assignments: a (stage 0'
    registry.announce(_peer("o", forged, cpb.PEER_STATE_SERVING, stage=0))
    await _placing(assignments, said, 1)
    assert '(1 by job "x\\"; left out after 3 assignments: a (stage 0")' in said[0], said[0]


async def test_a_peer_that_refused_the_job_is_named_with_its_refusal_not_as_measuring() -> None:
    said: list[str] = []
    registry, assignments = placement(FakeClock(), 60.0, said)
    refusal = "measuring its stages failed (OutOfMemoryError: ...)"
    registry.announce(_peer("r", "", cpb.PEER_STATE_JOINING, refused_job="j", refused=refusal))
    await _placing(assignments, said, 1)
    assert "not measured yet" not in said[0] and "; refused by r: " in said[0], said[0]


async def test_a_job_whose_servers_are_all_there_measuring_asks_for_none_more() -> None:
    """Five servers started for a job of four stages, measuring it: the message asked to
    "start a stage server for this job ... (4 more)" (as `make demo` showed)."""
    said: list[str] = []
    registry, assignments = placement(FakeClock(), 60.0, said)
    for k in range(5):
        registry.announce(_peer(f"m{k}", "", cpb.PEER_STATE_JOINING))
    await _placing(assignments, said, 4)
    assert said[0] == (
        "waiting for peers: stages 0, 1, 2, 3 without a replica; this job's 4 stage(s) need at "
        "least 4 stage server(s), one per stage (0 served, 0 more peer(s) measured): placed once "
        "measured (4 more needed); present: 5 free stage server(s) not measured yet (measuring, "
        "or about to)"
    )


async def _placing(assignments: Assignments, said: list[str], stages: int) -> None:
    """Placement of job "j" of `stages`, until it has said what it waits for."""
    placing = asyncio.create_task(assignments.place("j", stages, lambda: 0, []))
    try:
        await wait_until(lambda: bool(said), "the job says what it waits for", timeout_s=5)
    finally:
        placing.cancel()
        await asyncio.gather(placing, return_exceptions=True)
