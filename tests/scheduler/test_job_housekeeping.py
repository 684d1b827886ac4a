"""The scheduler's care of stored jobs (issue 27, items 12 and 14): a job's stages are partitioned
once, off the event loop, and a stored job over the bounds fails instead of freezing it; finished
jobs beyond the retention setting are deleted with their files, at start and as jobs end. A real
store and a real `Scheduler`; the bus takes publications and delivers nothing (no peers)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import scheduler.service
from scheduler.coordinator import LocalCoordinator
from scheduler.job_api import job_status
from scheduler.service import Scheduler, SchedulerOptions
from scheduler.store import JobState, JobStore
from swarm.errors import FailedPrecondition
from swarm.job.config import JobConfig, load_job
from swarm.model import checkpoint
from swarm.model.transformer import layer_costs, partition
from swarm.net.commit_auth import KEY_FILE
from swarm.rpc.lease import Replica
from tests.support.fakes import SilentBus
from tests.support.jobs import BASE, render, write_job
from tests.support.waiting import wait_until

WAIT_S = 10.0
_close = checkpoint.StageWriter.close  # the real one, under a held one's spy


def _state(store: JobStore, job_id: str) -> JobState | None:
    record = store.get(job_id)
    return None if record is None else record.state


async def test_a_stored_job_over_the_bounds_fails_at_restart_and_freezes_nothing(
    tmp_path: Path,
) -> None:
    """20,000 layers over 2,000 stages, stored by a scheduler without bounds: partitioning it on
    the event loop (each GetJob, ListJobs) took about two days."""
    model, training = {**BASE["model"], "n_layers": 20000}, {**BASE["training"], "stages": 2000}
    spec = render({**BASE, "model": model, "training": training})
    with JobStore(tmp_path / "jobs.sqlite") as store:
        job_id = store.create("huge", spec, str(tmp_path), 3).id
        scheduler = Scheduler(store, SilentBus(), SchedulerOptions(tmp_path / "ckpt"))  # type: ignore[arg-type]
        stop = asyncio.Event()
        running = asyncio.create_task(scheduler.run(stop))
        try:
            record = store.get(job_id)
            assert record is not None and job_status(record, scheduler).stages == []  # GetJob
            await wait_until(lambda: _state(store, job_id) == "failed", timeout_s=WAIT_S)
            record = store.get(job_id)
            assert record is not None
            assert "model.n_layers = 20000 is not allowed" in record.error, record.error
            assert "MAX_LAYERS" in record.error and job_status(record, scheduler).stages == []
        finally:
            stop.set()
            await asyncio.wait_for(running, WAIT_S)


async def test_a_jobs_stages_are_partitioned_once_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[threading.Thread] = []

    def watched(costs: list[float], stages: int) -> list[range]:
        threads.append(threading.current_thread())
        return partition(costs, stages)

    monkeypatch.setattr(scheduler.service, "partition", watched)  # a spy: the real partition runs
    path = write_job(tmp_path, model={"n_layers": 6})
    job = load_job(path)
    with JobStore(tmp_path / "jobs.sqlite") as store:
        job_id = store.create(job.name, path.read_text(), str(tmp_path), 3).id
        sched = Scheduler(store, SilentBus(), SchedulerOptions(tmp_path / "ckpt"))  # type: ignore[arg-type]
        stop = asyncio.Event()
        running = asyncio.create_task(sched.run(stop))
        try:
            await wait_until(lambda: bool(sched.stages(job_id)), timeout_s=WAIT_S)
            for _ in range(3):  # as GetJob and ListJobs ask, again and again
                stages = sched.stages(job_id)
            want = partition(layer_costs(job.model), job.training.stages)
            assert [list(s.layers) for s in stages] == [list(r) for r in want]
            assert len(threads) == 1 and threads[0] is not threading.main_thread()
        finally:
            stop.set()
            await asyncio.wait_for(running, WAIT_S)


def _ended(store: JobStore, ckpt: Path, state: JobState) -> str:
    job_id = store.create("done", render(BASE), "/", 3).id
    for now in ("placing", "running", state) if state == "succeeded" else (state,):
        store.set_state(job_id, now)  # type: ignore[arg-type]
    (ckpt / job_id).mkdir(parents=True)
    (ckpt / job_id / "final.pt").write_bytes(b"model")
    return job_id


async def test_finished_jobs_beyond_the_retention_are_deleted_with_their_files(
    tmp_path: Path,
) -> None:
    ckpt, now = tmp_path / "ckpt", [1000.0]
    with JobStore(tmp_path / "jobs.sqlite", clock=lambda: now[0]) as store:
        ended = []
        for state in ("succeeded", "failed", "cancelled"):
            now[0] += 1
            ended.append(_ended(store, ckpt, state))  # type: ignore[arg-type]
        live = store.create("live", render(BASE), str(tmp_path), 3).id
        opts = SchedulerOptions(ckpt, keep_finished_jobs=2)
        sched = Scheduler(store, SilentBus(), opts)  # type: ignore[arg-type]
        stop = asyncio.Event()
        running = asyncio.create_task(sched.run(stop))
        try:
            await wait_until(
                lambda: store.get(ended[0]) is None, timeout_s=WAIT_S
            )  # at start: the oldest one
            assert not (ckpt / ended[0]).exists()
            assert all(store.get(j) and (ckpt / j / "final.pt").exists() for j in ended[1:])
            await wait_until(lambda: _state(store, live) == "placing", timeout_s=WAIT_S)
            now[0] += 1
            store.set_state(live, "cancelled")  # as the job API cancels
            sched.cancelled(live)
            await wait_until(lambda: store.get(ended[1]) is None, timeout_s=WAIT_S)  # as a job ends
            assert not (ckpt / ended[1]).exists()
            assert [r.id for r in store.list()] == [live, ended[2]]
        finally:
            stop.set()
            await asyncio.wait_for(running, WAIT_S)


async def test_delete_removes_the_files_of_a_finished_job_only(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    with JobStore(tmp_path / "jobs.sqlite") as store:
        gone, kept = _ended(store, ckpt, "succeeded"), _ended(store, ckpt, "failed")
        live = store.create("live", render(BASE), "/", 3).id
        sched = Scheduler(store, SilentBus(), SchedulerOptions(ckpt))  # type: ignore[arg-type]
        await sched.delete(gone)
        assert not (ckpt / gone).exists() and (ckpt / kept / "final.pt").exists()
        await sched.delete(gone)  # nothing left to remove: fine
        with pytest.raises(FailedPrecondition, match="cancel it first"):
            await sched.delete(live)


# -- a job still shutting down: DeleteJob and retention wait for its writes ------------------------
class _HeldSave:
    """`checkpoint.StageWriter.close` (a stage file's last write and fsync) held in its thread
    until `release`: a checkpoint write in flight (a large stage on a slow disk), which
    cancelling the task that awaits it does not stop."""

    def __init__(self) -> None:
        self.started, self.release, self.wrote = (
            threading.Event(),
            threading.Event(),
            threading.Event(),
        )

    def __call__(self, writer: checkpoint.StageWriter) -> None:
        self.started.set()
        self.release.wait(WAIT_S)
        _close(writer)
        self.wrote.set()


class _Replica:
    """Enough of a `StageReplica` for a checkpoint: its state at step 2."""

    async def download_state(
        self, include_optimizer: bool = False, prefix: str = "param/"
    ) -> tuple[int, dict[str, torch.Tensor]]:
        return 2, {"param/w": torch.zeros(2)}

    async def stream_state(self, sink: Any, include_optimizer: bool = False) -> int:
        await sink(2, "param/w", torch.zeros(2))
        return 2

    async def max_state_tensors(self) -> int:
        return 1

    async def close(self) -> None:
        pass


def _checkpointing(sched: Scheduler, monkeypatch: pytest.MonkeyPatch, ckpt: Path) -> _HeldSave:
    """Each job's training: a real coordinator (no peers: its replicas are `_Replica`s) that
    starts writing the checkpoint of step 2, then trains until cancelled, and closes."""
    held = _HeldSave()
    monkeypatch.setattr(checkpoint.StageWriter, "close", lambda w: held(w))

    async def place(*args: Any) -> None:
        pass  # placed at once: there are no peers

    async def training(job_id: str, job: JobConfig, assigned: list[str]) -> None:
        members = [[Replica("p", "127.0.0.1:1")] for _ in range(job.training.stages)]
        coordinator = LocalCoordinator(
            job,
            job_id,
            lambda: members,
            checkpoint_dir=ckpt / job_id,
            connect=lambda stage, replica: _Replica(),  # type: ignore[arg-type, return-value]
        )
        try:
            coordinator.recovery.checkpoint(2, members)
            await asyncio.Event().wait()  # training, until cancelled
        finally:
            await coordinator.close()

    monkeypatch.setattr(sched.assignments, "place", place)
    monkeypatch.setattr(sched._training, "run", training)
    return held


async def _cancelled_while_saving(
    store: JobStore, sched: Scheduler, held: _HeldSave, job_id: str
) -> None:
    assert await asyncio.to_thread(held.started.wait, WAIT_S), "no checkpoint write started"
    store.set_state(job_id, "cancelled", message="cancelled on request")  # as CancelJob does
    sched.cancelled(job_id)


async def test_a_cancelled_job_is_deleted_only_once_its_checkpoint_write_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CancelJob stores "cancelled" and cancels the job's task at once; a checkpoint write in
    flight goes on in its thread. DeleteJob used to remove the job's directory meanwhile, and the
    write then made it again: files no record names, that retention never finds."""
    ckpt = tmp_path / "ckpt"
    path = write_job(tmp_path)
    with JobStore(tmp_path / "jobs.sqlite") as store:
        job_id = store.create("held", path.read_text(), str(tmp_path), 3).id
        sched = Scheduler(store, SilentBus(), SchedulerOptions(ckpt))  # type: ignore[arg-type]
        held = _checkpointing(sched, monkeypatch, ckpt)
        stop = asyncio.Event()
        running = asyncio.create_task(sched.run(stop))
        try:
            await _cancelled_while_saving(store, sched, held, job_id)
            deleting = asyncio.create_task(sched.delete(job_id))  # as DeleteJob does
            await asyncio.sleep(0.05)
            early = deleting.done()  # deleted while the write went on
            held.release.set()
            await asyncio.wait_for(deleting, WAIT_S)
            store.delete(job_id)
            assert await asyncio.to_thread(held.wrote.wait, WAIT_S)
            # The scheduler's own commit key lives beside the jobs' directories: no job's file.
            left = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.name != KEY_FILE)
            assert left == [], f"orphaned after DeleteJob (done before the write ended: {early})"
            assert not early
        finally:
            held.release.set()
            stop.set()
            await asyncio.wait_for(running, WAIT_S)


async def test_deleting_a_job_still_shutting_down_is_refused_after_a_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = tmp_path / "ckpt"
    path = write_job(tmp_path)
    with JobStore(tmp_path / "jobs.sqlite") as store:
        job_id = store.create("held", path.read_text(), str(tmp_path), 3).id
        opts = SchedulerOptions(ckpt, shutdown_wait_s=0.05)
        sched = Scheduler(store, SilentBus(), opts)  # type: ignore[arg-type]
        held = _checkpointing(sched, monkeypatch, ckpt)
        stop = asyncio.Event()
        running = asyncio.create_task(sched.run(stop))
        try:
            await _cancelled_while_saving(store, sched, held, job_id)
            with pytest.raises(FailedPrecondition, match=r"still shutting down.*try again"):
                await sched.delete(job_id)
            assert store.get(job_id) is not None and not held.wrote.is_set()
            held.release.set()
            await asyncio.to_thread(held.wrote.wait, WAIT_S)
            await wait_until(lambda: job_id not in sched._tasks, timeout_s=WAIT_S)
            await sched.delete(job_id)  # shut down now
            assert not (ckpt / job_id).exists()
        finally:
            held.release.set()
            stop.set()
            await asyncio.wait_for(running, WAIT_S)


async def test_retention_deletes_a_job_only_once_its_checkpoint_write_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt, now = tmp_path / "ckpt", [1000.0]
    path = write_job(tmp_path)
    with JobStore(tmp_path / "jobs.sqlite", clock=lambda: now[0]) as store:
        job_id = store.create("held", path.read_text(), str(tmp_path), 3).id
        opts = SchedulerOptions(ckpt, keep_finished_jobs=1)
        sched = Scheduler(store, SilentBus(), opts)  # type: ignore[arg-type]
        held = _checkpointing(sched, monkeypatch, ckpt)
        stop = asyncio.Event()
        running = asyncio.create_task(sched.run(stop))
        try:
            await _cancelled_while_saving(store, sched, held, job_id)
            now[0] += 1
            newer = _ended(store, ckpt, "succeeded")  # ended since: the one job kept
            await sched._retention.sweep()  # a sweep (another job ended) while the write goes on
            held.release.set()
            assert await asyncio.to_thread(held.wrote.wait, WAIT_S)
            await wait_until(
                lambda: store.get(job_id) is None, timeout_s=WAIT_S
            )  # at the job's own end
            await wait_until(lambda: job_id not in sched._tasks, timeout_s=WAIT_S)
            assert not (ckpt / job_id).exists(), "orphaned after the retention sweep"
            assert (ckpt / newer / "final.pt").exists()
        finally:
            held.release.set()
            stop.set()
            await asyncio.wait_for(running, WAIT_S)
