"""A `JobTraining` over stage servers in this process (`tests.support.inprocess.Swarm`), as the
scheduler builds one for its jobs, without a broker or a peer registry: what it asks of them is
answered from the swarm (`Peers`), and every stage is served already (`Assignments`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter

from scheduler.coordinator.metrics import CoordinatorFamilies
from scheduler.history import History
from scheduler.job_training import JobTraining
from scheduler.stalls import Health
from scheduler.store import JobState, JobStore
from swarm.job.config import JobConfig
from swarm.rpc.lease import Replica
from tests.support.fakes import SilentBus
from tests.support.inprocess import Swarm

__all__ = ["Assignments", "Peers", "job_training"]


class Peers:
    """What JobTraining asks of the peer registry: the stage servers, per stage, and the peers'
    announcements (none here: equal parts, no aggregators)."""

    def __init__(self, swarm: Swarm) -> None:
        self.swarm = swarm
        self.peers: dict[str, object] = {}

    def members(self, job_id: str, stages: int) -> list[list[Replica]]:
        return self.swarm.members()

    def given(self, job_id: str, peer: str) -> int | None:
        """The stage `peer` serves: every server of the swarm was put on its stage as it was
        started, as the scheduler gives one."""
        return next(
            (
                k
                for k, stage in enumerate(self.swarm.members())
                if any(r.peer == peer for r in stage)
            ),
            None,
        )

    def domains(self) -> dict[str, object]:
        return {}  # no failure domains known: no warning of them

    def lost_relays(self, job_id: str, stages: object) -> dict[int, str]:
        return {}  # no relay lost


class Assignments:
    lost_stage_grace_s = 30.0  # the scheduler's default: a start waits this long for holders

    def floor(self, job: JobConfig) -> int:
        return 1

    async def grow(self, job_id: str, stages: int, assigned: list[str], floor: int) -> None:
        await asyncio.Event().wait()  # every stage is served already


def job_training(
    store: JobStore,
    swarm: Swarm,
    checkpoint_dir: Path,
    set_status: Callable[[str, JobState | None, str], Awaitable[None]],
    embedded_trainer: bool = True,
) -> JobTraining:
    """A JobTraining of `store`'s jobs over `swarm`, with an embedded trainer unless told not
    to (`swarm scheduler --no-embedded-trainer`: the test runs its trainers)."""

    async def announce(job_id: str) -> None:
        pass

    return JobTraining(
        store,
        SilentBus(),
        Peers(swarm),  # type: ignore[arg-type]
        Assignments(),  # type: ignore[arg-type]
        checkpoint_dir,
        None,
        embedded_trainer,
        None,
        announce,
        set_status,
        CoordinatorFamilies(CollectorRegistry()),
        Counter("moves", "moves", ["job"], registry=CollectorRegistry()),
        {},
        {},
        History(store),
        lambda _: Health(),
    )
