"""A scheduled job that cannot progress says so, and why (issue 63, item 4): its stage refuses
every push (real gRPC stage servers in this process, under the scheduler's `JobTraining` and its
embedded trainer), so no step commits; after the job's `runtime.patience_s` its state is
`stalled` and its message, as `swarm status` prints it, names the refusal's code and text. Once
the stage serves again the job carries on by itself: `running`, and its steps commit."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest

from client.live import status_lines
from client.trainer import PipelineTrainer
from scheduler.store import JobRecord, JobState, JobStore
from scheduler.store_bans import BanRow
from swarm.deadline import within
from swarm.errors import FailedPrecondition, SwarmError
from swarm.job.config import JobConfig
from swarm.job.states import job_state_proto
from swarm.proto import scheduler_pb2 as spb
from tests.support.inprocess import Swarm
from tests.support.job_training import job_training
from tests.support.jobs import make_job
from tests.support.refusing import Refusing

pytestmark = pytest.mark.timeout(120)

REFUSAL = "handover refused: a malformed CUDA handover (66 bytes)"


def _job(tmp_path: Path) -> JobConfig:
    """One microbatch a step, and steps enough to outlast the test (it is cancelled at the
    end); patience short, no rebalancing."""
    training = {"stages": 2, "steps": 100_000, "target_batch_size": 4}
    runtime = {"data_plane": "push", "patience_s": 2.0}
    return make_job(tmp_path, training=training, runtime=runtime, rebalance={"enabled": False})


async def test_a_job_whose_stage_always_fails_is_stalled_with_the_cause_then_carries_on(
    tmp_path: Path,
) -> None:
    job = _job(tmp_path)
    swarm = Swarm(job)
    said: list[tuple[JobState | None, str]] = []

    async def set_status(job_id: str, state: JobState | None, text: str) -> None:
        said.append((state, text))
        if state is None:  # as the scheduler keeps it, for `swarm status`
            store.set_message(job_id, text)
        else:
            store.set_state(job_id, state, message=text)

    with JobStore(tmp_path / "jobs.sqlite") as store:
        job_id = store.create(job.name, "", str(tmp_path), job.training.steps).id
        store.set_state(job_id, "placing")
        training_run = job_training(store, swarm, tmp_path / "ckpt", set_status)
        run: asyncio.Task[None] | None = None
        try:
            for stage in range(job.training.stages):
                server = await swarm.add(stage)
                server.servicer.serve(server.runtime, job_id)  # as the scheduler assigned it
            refusing = Refusing(swarm.servers[1][0], FailedPrecondition(REFUSAL))
            run = asyncio.create_task(training_run.run(job_id, job, []))
            async with asyncio.timeout(60):
                while not any(state == "stalled" for state, _ in said):
                    assert not run.done(), f"the run ended: {run.exception()!r}"
                    await asyncio.sleep(0.05)
            text = next(text for state, text in said if state == "stalled")
            assert text.startswith("stalled at step 0: cannot progress"), text
            assert f"FAILED_PRECONDITION: {REFUSAL}" in text, text
            assert "carries on by itself once the cause clears" in text, text
            shown = status_lines(_status(store.get(job_id)))  # what `swarm status` prints
            assert "state    stalled" in shown and f"message  {text}" in shown, shown
            refusing.on = False  # the cause clears
            stalled = next(i for i, (state, _) in enumerate(said) if state == "stalled")
            async with asyncio.timeout(60):
                while not any(state == "running" for state, _ in said[stalled:]):
                    assert not run.done(), f"the run ended: {run.exception()!r}"
                    await asyncio.sleep(0.05)
            assert not run.done(), f"the run ended: {run.exception()!r}"
        finally:
            if run is not None:
                run.cancel()
                await asyncio.gather(run, return_exceptions=True)
            await swarm.close()
    states = [state for state, _ in said[stalled:] if state is not None]
    assert states[:2] == ["stalled", "running"], said
    assert swarm.servers[0][0].runtime.step > 0, "it trains again"


async def test_a_remote_trainers_cause_reaches_the_stalled_status(tmp_path: Path) -> None:
    # `--no-embedded-trainer`: the only trainer is one of the scheduler's remote ones, whose
    # calls its job API hands to the job's coordinator (`Scheduler.report`). Its failures
    # stayed in its own log: the job read "stalled at step 0: no step committed ...; see the
    # scheduler's log", whose log did not have the cause either.
    _, (text, *_) = await _stalled_without_the_embedded_trainer(
        _job(tmp_path), tmp_path, remote=True
    )
    assert text.startswith("stalled at step 0: cannot progress"), text
    assert f"FAILED_PRECONDITION: {REFUSAL}" in text, text


async def _stalled_without_the_embedded_trainer(
    job: JobConfig, tmp_path: Path, *, remote: bool, after_s: float = 0.0
) -> tuple[str, list[str]]:
    """(the job's id, its statuses from the first stalled one on, `after_s` more) under
    `--no-embedded-trainer`: with `remote`, stage 1 refuses every call and a remote trainer (the
    coordinator's, as the job API hands it) trains; without, no trainer at all, a trainer gone
    before having left its last failure."""
    swarm = Swarm(job)
    said: list[tuple[JobState | None, str]] = []

    async def set_status(job_id: str, state: JobState | None, text: str) -> None:
        said.append((state, text))

    with JobStore(tmp_path / "jobs.sqlite") as store:
        job_id = store.create(job.name, "", str(tmp_path), job.training.steps).id
        store.set_state(job_id, "placing")
        training_run = job_training(store, swarm, tmp_path / "ckpt", set_status, False)
        run: asyncio.Task[None] | None = None
        trainer: PipelineTrainer | None = None
        trains: asyncio.Task[None] | None = None
        try:
            for stage in range(job.training.stages):
                server = await swarm.add(stage)
                server.servicer.serve(server.runtime, job_id)
            if remote:
                Refusing(swarm.servers[1][0], FailedPrecondition(REFUSAL))
            run = asyncio.create_task(training_run.run(job_id, job, []))
            async with asyncio.timeout(30):
                while job_id not in training_run.coordinators:
                    await asyncio.sleep(0.05)
            coordinator = training_run.coordinators[job_id]
            if remote:
                trainer = PipelineTrainer(job, coordinator, job_id=job_id, trainer_id="remote-1")
                trains = asyncio.create_task(trainer.run())
            else:
                coordinator.trainers_failure = "UNAVAILABLE: a gone trainer's last failure"
            async with asyncio.timeout(60):
                while not any(state == "stalled" for state, _ in said):
                    assert not run.done(), f"the run ended: {run.exception()!r}"
                    assert trains is None or not trains.done(), f"it ended: {trains.exception()!r}"
                    await asyncio.sleep(0.05)
            await asyncio.sleep(after_s)
        finally:
            for task in (trains, run):
                if task is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
            if trainer is not None:
                await trainer.close()
            await swarm.close()
    first = next(i for i, (state, _) in enumerate(said) if state == "stalled")
    return job_id, [text for _, text in said[first:]]


def _status(record: JobRecord | None) -> spb.JobStatus:
    assert record is not None
    return spb.JobStatus(
        job=record.id,
        name=record.name,
        state=job_state_proto(record.state),
        step=record.step,
        steps=record.steps,
        loss=math.nan,
        message=record.message,
        created=record.created,
        updated=record.updated,
    )


async def test_a_job_no_trainer_asks_for_work_is_stalled_saying_so(tmp_path: Path) -> None:
    """`--no-embedded-trainer` and no `swarm trainer` started (or every one gone): the job
    waits for a trainer. Its status said nothing of it (no step, no failure: not even stalled)
    or, after a step, blamed a hung replica (a review found it)."""
    training = {"stages": 2, "steps": 100_000, "target_batch_size": 4}
    runtime = {"data_plane": "push", "patience_s": 2.0, "lease_timeout_s": 1.0}
    job = make_job(tmp_path, training=training, runtime=runtime, rebalance={"enabled": False})
    job_id, said = await _stalled_without_the_embedded_trainer(
        job, tmp_path, remote=False, after_s=2.5
    )
    text = said[0]
    assert text.startswith("stalled at step 0: cannot progress"), text
    # first: the last failure of a trainer gone is not why (a review found it named instead)
    assert "; the last failure: no trainer has asked for work since " in text, text
    # a time, not a count of seconds: said once, not rewritten at each look (each write sends
    # the job's announcement, its spec with it, to every peer)
    assert said == [text], said
    start = f"start one: swarm trainer --scheduler HOST:PORT --job {job_id}"
    assert f"runs none of its own (--no-embedded-trainer); {start}" in text, text


async def test_a_stage_whose_only_replica_is_banned_says_so(tmp_path: Path) -> None:
    """The one server of stage 1 is banned from the job (a ban kept from before: a restart
    reads it): the coordinator leaves it out, so the stage has no replica. The attempt's start
    failed with "no replica of stages [1] is at step 0" while the stage looked served, and the
    scheduler tried again and again with that alone (a review found it): the ban is named,
    and what to do."""
    job = _job(tmp_path)
    swarm = Swarm(job)

    async def set_status(job_id: str, state: JobState | None, text: str) -> None:
        pass

    with JobStore(tmp_path / "jobs.sqlite") as store:
        job_id = store.create(job.name, "", str(tmp_path), job.training.steps).id
        store.set_state(job_id, "placing")
        training_run = job_training(store, swarm, tmp_path / "ckpt", set_status)
        training_run.assignments.lost_stage_grace_s = 1.0  # the start's wait for stage 1
        try:
            for stage in range(job.training.stages):
                server = await swarm.add(stage)
                server.servicer.serve(server.runtime, job_id)
            banned = swarm.servers[1][0].address  # its peer id here
            reason = "its contribution to stage 1's sum was off by 50 (a test's)"
            store.record_ban(job_id, BanRow(banned, 1, 0, 0, reason, replayed=True))
            with pytest.raises(SwarmError) as failed:
                await within(training_run.run(job_id, job, []), 30.0)
        finally:
            await swarm.close()
    assert str(failed.value) == (
        "no replica of stages [1] is at step 0: the servers on it are banned from this job "
        f"(stage 1: {banned}); start a stage server for it, which takes the stage"
    )
