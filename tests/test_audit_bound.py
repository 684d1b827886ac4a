"""A late audit ends before the next step commits (docs/decisions.md, "A late audit ends before
the next step commits"), with real gRPC servers in this process.

Every stage and every contribution is audited (`audit_fraction` 1). The trainer's `Record` calls
of step 0's audits (what their re-executions redo a stage from) are held until step 1 has
committed, or until the trainer waits for them to report a microbatch of step 1, whichever
comes first: a machine slow enough that step 0's deferred audits lag behind step 1, forced.

On the old code step 1 committed first, with step 0's audits still out: step 0's contributions
were judged at their bound (`Contributions.bound`) without their digests, skipped ("is skipped:
0 of its N microbatches digested"), and the audits themselves cut once step 2 was given. A liar
whose lies' audits all lagged so was never judged (tests/system/test_poison_push.py
`P-push-bent` under load). Now a microbatch of step 1 is reported only once step 0's audits
ended: none is out when step 1 commits, none is cut, and the job still ends equal to `swarm
local`."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from client.audit.push_audit import PushAudits
from client.metrics import TrainerMetrics
from client.trainer import PipelineTrainer
from scheduler.coordinator import LocalCoordinator, gather_state
from swarm.job.fingerprint import fingerprint
from swarm.ops.progress import StepRecord
from swarm.rpc.stage_client import StageClient
from tests.support.audited_push import audited_push_swarm
from tests.support.equality import assert_equal_to_local
from tests.support.inprocess import Swarm

pytestmark = pytest.mark.timeout(180)


async def test_a_step_is_not_reported_before_the_last_steps_audits_end(
    tmp_path: Path,
    make_swarm: list[Swarm],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    job, swarm = await audited_push_swarm(tmp_path, make_swarm)
    released = asyncio.Event()  # step 0's audits' Record calls may go on
    why: list[str] = []  # what released them first

    def release(reason: str) -> None:
        if not released.is_set():
            why.append(reason)
            released.set()

    out_at_commit: list[tuple[int, int]] = []  # the audits still running when step 1 committed

    async def on_step(record: StepRecord) -> None:
        if record.step == 1:
            trust = trainer.plane.trust  # type: ignore[attr-defined]
            assert isinstance(trust, PushAudits)
            out_at_commit.extend(trust.late.running)
            release("step 1 committed")

    class Held(StageClient):
        """The trainer's client: the audits' Record calls of step 0 wait to be released."""

        async def record(self, step: int, index: int, run: int, *, tensors: bool) -> Any:
            if step == 0:
                await released.wait()
            return await super().record(step, index, run, tensors=tensors)

    settled = PushAudits.settled

    async def waited(audits: PushAudits, before: int) -> None:
        if before >= 1:
            release(f"a microbatch of step {before} waits for the audits before it")
        await settled(audits, before)

    monkeypatch.setattr(PushAudits, "settled", waited)
    coordinator = LocalCoordinator(job, fingerprint(job), swarm.members, on_step=on_step)
    metrics = TrainerMetrics(fingerprint(job), CollectorRegistry())
    trainer = PipelineTrainer(job, coordinator, metrics=metrics, seed=0, client_factory=Held)
    try:
        with caplog.at_level(logging.WARNING):
            await coordinator.start()
            await asyncio.wait_for(asyncio.gather(trainer.run(), coordinator.finished.wait()), 120)
        assert coordinator.error is None
        assert_equal_to_local(job, await gather_state(coordinator), tol=1e-9)
    finally:
        await trainer.close()
        await coordinator.close()
    # none of step 0's audits outlived step 1's commit: every digest they took was there when
    # the coordinator judged step 0's contributions at that bound
    assert not [at for at in out_at_commit if at[0] == 0], out_at_commit
    assert why == ["a microbatch of step 1 waits for the audits before it"], why
    said = [r.getMessage() for r in caplog.records if "was cut" in r.getMessage()]
    assert said == [], said
    assert metrics._audits.labels(job=fingerprint(job), outcome="cut")._value.get() == 0
    assert coordinator.bans.contributions._waiting == {}
    assert coordinator.bans.banned == {}
