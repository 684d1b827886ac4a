"""A coordinator's close cancelled part-way (a `swarm cancel` while the job's last checkpoint is
flushed) still closes every part: its members' and its replicas' connections were left open
when the wait for the checkpoint was cancelled (a review found it)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from swarm.deadline import within
from swarm.job.fingerprint import fingerprint
from tests.support.coordinator import MakeHarness, job_of
from tests.support.replicas import FakeSwarm


async def test_a_close_cancelled_while_the_checkpoint_flushes_closes_the_rest(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    job = job_of(tmp_path)
    swarm = FakeSwarm(fingerprint(job), 2)
    swarm.add(0, "a"), swarm.add(1, "b")
    coordinator = make_harness(job, swarm).coordinator
    await coordinator.start()
    closed: list[str] = []
    flushing = asyncio.Event()

    async def flushes_for_ever(finished: bool) -> None:
        flushing.set()
        await asyncio.Event().wait()

    def closes(part: str, close: object) -> object:
        async def recorded() -> None:
            closed.append(part)
            await close()  # type: ignore[operator]

        return recorded

    real_close = coordinator.recovery.close
    coordinator.recovery.close = flushes_for_ever  # type: ignore[method-assign]
    coordinator.membership.close = closes("members", coordinator.membership.close)  # type: ignore[method-assign]
    coordinator.clients.close = closes("clients", coordinator.clients.close)  # type: ignore[method-assign]
    closing = asyncio.create_task(coordinator.close())
    await within(flushing.wait(), 5.0)
    closing.cancel()
    await asyncio.gather(closing, return_exceptions=True)
    coordinator.recovery.close = real_close  # type: ignore[method-assign]  # the harness's close
    assert closed == ["members", "clients"]
