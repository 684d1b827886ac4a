"""Issue 69 item 4, with real gRPC servers in this process: a push-plane step's commit no longer
waits for the audits of its last microbatches (`client.audit.late_audits`). Every stage of every
microbatch is audited (`audit_fraction` 1, every contribution drawn too) and the trainer's
`Record` calls of step 0 are held until step 0 has committed: on the old code the step's
microbatches were reported only once their audits ended, so step 0 never committed and the job
hung (its bounded wait failed). Now step 0 commits with its audits still out, its contributions'
judgements waiting for their digests; the audits run on after the auditors applied step 0's
update (their re-executions in turn with the pushes there; the last step's, which gate, ahead of
them), on step 0's parameters, kept for them by a replica that recorded a push of it
(`stage_server.replica.prior_params`), or are refused as stale and skipped; never a
disagreement, so no honest replica is accused, and the job ends equal to `swarm local`."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from client.audit.push_audit import PushAudits
from client.metrics import TrainerMetrics
from client.trainer import PipelineTrainer
from scheduler.coordinator import LocalCoordinator, gather_state
from stage_server.replica.answering import Answering
from swarm.job.fingerprint import fingerprint
from swarm.ops.progress import StepRecord
from swarm.rpc.stage_client import StageClient
from tests.support.audited_push import audited_push_swarm
from tests.support.equality import assert_equal_to_local
from tests.support.inprocess import Swarm

pytestmark = pytest.mark.timeout(180)

OUTCOMES = ("agreed", "caught", "undecided", "skipped", "cut")


async def test_a_step_commits_while_its_last_audits_are_still_out(
    tmp_path: Path, make_swarm: list[Swarm], monkeypatch: pytest.MonkeyPatch
) -> None:
    job, swarm = await audited_push_swarm(tmp_path, make_swarm)
    committed = asyncio.Event()  # step 0 applied: its audits' Record calls may go on
    out_at_commit: list[tuple[int, int]] = []  # the audits still running when step 0 committed
    waiting: list[tuple[int, int, str]] = []  # the contributions' judgements waiting then
    trainers: list[PipelineTrainer] = []

    def late(trainer: PipelineTrainer) -> PushAudits:
        trust = trainer.plane.trust  # type: ignore[attr-defined]
        assert isinstance(trust, PushAudits)
        return trust

    async def on_step(record: StepRecord) -> None:
        if record.step == 0:
            out_at_commit.extend(late(trainers[0]).late.running)
            waiting.extend(coordinator.bans.contributions._waiting)
            committed.set()

    class Held(StageClient):
        """The trainer's client: the audits' Record calls of step 0 wait for its commit."""

        async def record(self, step: int, index: int, run: int, *, tensors: bool) -> Any:
            if step == 0:
                await committed.wait()
            return await super().record(step, index, run, tensors=tensors)

    redone: set[tuple[int, bool]] = set()  # the auditors' re-executions: (step, late)
    place = Answering.run

    def placed(answering: Answering, h: Any) -> Any:
        if answering.redoes(h):
            redone.add((h.microbatch.step, h.late))
        return place(answering, h)

    monkeypatch.setattr(Answering, "run", placed)
    coordinator = LocalCoordinator(job, fingerprint(job), swarm.members, on_step=on_step)
    metrics = TrainerMetrics(fingerprint(job), CollectorRegistry())
    trainers.append(PipelineTrainer(job, coordinator, metrics=metrics, seed=0, client_factory=Held))
    try:
        await coordinator.start()
        await asyncio.wait_for(asyncio.gather(trainers[0].run(), coordinator.finished.wait()), 120)
        assert coordinator.error is None
        assert_equal_to_local(job, await gather_state(coordinator), tol=1e-9)
    finally:
        await trainers[0].close()
        await coordinator.close()
    microbatches = job.training.target_batch_size // job.training.microbatch_size
    assert out_at_commit and {step for step, _ in out_at_commit} == {0}
    assert len(out_at_commit) <= microbatches
    # every replica's contribution drawn (`audit_fraction` 1): step 0's were judged after its
    # round, as their digests came, on step 0's parameters (else an honest one is banned)
    assert waiting and {step for step, _, _ in waiting} == {0}
    assert coordinator.bans.contributions._waiting == {}
    outcome = metrics._audits.labels
    # Step 0's audits ran on after its update: on its parameters where the auditor kept them
    # (`stage_server.replica.prior_params`), else refused as stale and skipped; never a
    # disagreement with the step moved on.
    said = {o: outcome(job=fingerprint(job), outcome=o)._value.get() for o in OUTCOMES}
    assert said["caught"] == said["undecided"] == said["cut"] == 0, said
    assert said["agreed"] + said["skipped"] == job.training.steps * microbatches * 3, said
    assert coordinator.bans.banned == {}
    # a late audit's re-executions say so, and run in turn with the pushes at their auditors;
    # the job's last step's audits gate its microbatches' reports and run ahead of them
    assert redone == {(0, True), (1, True), (2, False)}
