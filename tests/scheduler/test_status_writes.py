"""A job's state and message on a full store (`scheduler.status_writes`): a write the store
refuses is held, said in the job's status, and written once there is room; the job goes on. On
the old code the refused write raised out of the job's task, the failure's own record was
refused alike, and the job was left with nothing running it while its status showed "queued"
for good."""

from __future__ import annotations

import asyncio
from pathlib import Path

from scheduler.history import History
from scheduler.service import Scheduler, SchedulerOptions
from scheduler.status_writes import StatusWrites
from scheduler.store import JobStore
from swarm.bus.broker import EmbeddedBroker
from tests.support.buses import bus
from tests.support.disks import fill, tiny_disk
from tests.support.fakes import SilentBus
from tests.support.jobs import write_job
from tests.support.waiting import wait_until

WAIT_S = 15.0


async def test_a_job_whose_placing_the_full_store_refused_goes_on_and_says_so(
    tmp_path: Path,
) -> None:
    spec_file = write_job(tmp_path)
    with tiny_disk(tmp_path / "disk", "1m") as disk, JobStore(disk / "jobs.db") as store:
        job_id = store.create("j", spec_file.read_text(), str(tmp_path), 3).id
        scheduler = Scheduler(store, SilentBus(), SchedulerOptions(tmp_path / "ckpt"))  # type: ignore[arg-type]
        filler = fill(disk)
        stop = asyncio.Event()
        running = asyncio.create_task(scheduler.run(stop))
        try:

            def said() -> list[str]:
                return scheduler.health(job_id)[1]

            await wait_until(
                lambda: any("job store refused" in w for w in said()), timeout_s=WAIT_S
            )
            assert "placing: waiting for peers" in said()[0], said()
            await asyncio.sleep(0.5)
            task = scheduler._tasks.get(job_id)
            assert task is not None and not task.done()  # the job waits for peers, as it should
            assert store.get(job_id).state == "queued"  # type: ignore[union-attr]
            filler.unlink()  # room again: the held write is written, the warning goes
            await wait_until(lambda: store.get(job_id).state == "placing", timeout_s=WAIT_S)  # type: ignore[union-attr]
            # placement's newest words, the state the held write carried
            assert store.get(job_id).message.startswith("waiting for peers")  # type: ignore[union-attr]
            assert not any("job store" in w for w in said())
        finally:
            stop.set()
            await asyncio.wait_for(running, WAIT_S)


async def test_a_jobs_end_waits_until_the_store_holds_it(tmp_path: Path) -> None:
    """Its end (succeeded, failed) is not let go held: a restart would place the job and train
    it again from its last checkpoint, its final model written already."""
    with tiny_disk(tmp_path / "disk") as disk, JobStore(disk / "jobs.db") as store:
        job_id = store.create("j", "", "/", 3).id
        store.set_state(job_id, "placing")
        store.set_state(job_id, "running")
        announced: list[str] = []

        async def announce(job: str) -> None:
            announced.append(job)

        writes = StatusWrites(store, History(store), announce, retry_s=(0.05, 0.2))
        filler = fill(disk)
        ended = asyncio.create_task(writes.written(job_id, "succeeded", "done"))
        await asyncio.sleep(0.5)
        assert not ended.done() and store.get(job_id).state == "running"  # type: ignore[union-attr]
        assert "succeeded: done" in (writes.warning(job_id) or "")
        assert announced == []
        filler.unlink()
        await asyncio.wait_for(ended, WAIT_S)
        assert store.get(job_id).state == "succeeded" and writes.warning(job_id) is None  # type: ignore[union-attr]
        assert job_id in announced


async def test_a_newer_state_over_a_held_one_goes_through_the_states_between(
    tmp_path: Path,
) -> None:
    """The store held "queued" while "placing" was held; the attempt's "running" then asked a
    move the store forbids (queued to running): FailedPrecondition, not the full disk, ended the
    attempt, and after its retries a job that trained was stored "failed". A review found it."""
    with tiny_disk(tmp_path / "disk") as disk, JobStore(disk / "jobs.db") as store:
        job_id = store.create("j", "", "/", 3).id
        writes = StatusWrites(store, History(store), _announce, retry_s=(30.0, 60.0))
        filler = fill(disk)
        assert not await writes.set(job_id, "placing", "waiting for peers")
        assert not await writes.set(job_id, "running", "training")  # raised here
        assert "running: training" in (writes.warning(job_id) or "")
        filler.unlink()
        await writes.written(job_id, "succeeded", "done")  # through placing and running
        record = store.get(job_id)
        assert record is not None and (record.state, record.message) == ("succeeded", "done")
        writes.close()


async def test_a_held_write_of_a_job_that_ended_meanwhile_is_dropped(tmp_path: Path) -> None:
    with tiny_disk(tmp_path / "disk") as disk, JobStore(disk / "jobs.db") as store:
        job_id = store.create("j", "", "/", 3).id
        writes = StatusWrites(store, History(store), _announce, retry_s=(0.05, 0.1))
        filler = fill(disk)
        assert not await writes.set(job_id, None, "waiting for peers")
        filler.unlink()
        store.set_state(job_id, "cancelled", message="cancelled on request")  # the user's
        await wait_until(lambda: writes.warning(job_id) is None, timeout_s=WAIT_S)
        record = store.get(job_id)
        assert record is not None and record.message == "cancelled on request"
        writes.close()


async def _announce(job_id: str) -> None:
    pass


async def test_the_schedulers_broker_link_down_is_in_each_jobs_status(tmp_path: Path) -> None:
    """Peers hear none of a job's announcements or assignments while the scheduler's own link
    to its broker is down: the job's status said only "waiting for peers ... start a stage
    server" (a review found it)."""
    spec_file = write_job(tmp_path)
    with JobStore(tmp_path / "jobs.db") as store:
        job_id = store.create("j", spec_file.read_text(), str(tmp_path), 3).id
        broker = EmbeddedBroker()
        await broker.start()
        async with bus(broker.url, "scheduler") as link:
            await link.wait_connected(WAIT_S)
            scheduler = Scheduler(store, link, SchedulerOptions(tmp_path / "ckpt"))
            assert scheduler.health(job_id)[1] == []
            await broker.stop()
            await wait_until(lambda: not link.connected, "the link drops", timeout_s=WAIT_S)
            warned = scheduler.health(job_id)[1]
            assert warned == [
                "the scheduler's link to its broker is down (its log says why, and each "
                "reconnect): peers hear nothing of this job until it is back"
            ]
