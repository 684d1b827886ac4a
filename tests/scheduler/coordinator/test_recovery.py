"""Checkpoints from members that send what no replica would load: the state is refused where it
arrives, nothing is written from it, the next member is asked, and the last sealed checkpoint
stays the one a rollback uses."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from scheduler.coordinator.recovery import Recovery
from scheduler.coordinator.replicas import ReplicaClients, grpc_replicas
from stage_server.replica.runtime import StageRuntime
from swarm.job.fingerprint import fingerprint
from swarm.model import checkpoint
from swarm.model.stage_state import initial_state
from swarm.rpc import state_streams
from swarm.rpc.lease import Replica
from tests.support.coordinator import MakeHarness
from tests.support.hostile import HostileStage, serving
from tests.support.jobs import make_job
from tests.support.replicas import FakeSwarm

pytestmark = pytest.mark.timeout(60)


async def test_a_checkpoint_is_never_written_from_a_state_of_the_wrong_shape(
    tmp_path: Path,
) -> None:
    job = make_job(tmp_path, training={"stages": 1})
    whole = initial_state(job, 0)
    name = next(iter(whole))
    spoiled = {**whole, name: torch.zeros(3, dtype=torch.float64)}
    honest = HostileStage(lambda: whole.items(), step=2)
    hostile = HostileStage(lambda: spoiled.items(), step=4)
    directory = tmp_path / "checkpoints"
    clients = ReplicaClients(grpc_replicas(job, "job"))
    recovery = Recovery(job, clients, directory)
    try:
        async with serving(honest) as good, serving(hostile) as bad:
            await recovery.save(2, [[Replica("good", good)]])
            await recovery.save(4, [[Replica("bad", bad)]])
            assert checkpoint.sealed(directory) == [2]  # the one before stays the latest
            assert [d.name for d in directory.iterdir()] == ["step-00000002"]  # nothing of 4
            honest.step = 4  # a member after the refused one is asked next
            await recovery.save(4, [[Replica("bad", bad), Replica("good", good)]])
    finally:
        await clients.close()
    assert checkpoint.sealed(directory) == [2, 4]
    StageRuntime(job, 0).load_state(4, checkpoint.load_stage(directory, 4, 0))  # a replica loads it


class _Told:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t


@pytest.mark.parametrize("mode", ["step", "local"])
def test_a_checkpoint_is_due_by_time_as_well_as_by_steps(tmp_path: Path, mode: str) -> None:
    # checkpoint_every = 100 steps of a slow job: a stage lost at step 89 would cost every step.
    # With every_s the first step boundary after that long is checkpointed too (with local
    # steps, only where a round starts: replicas share parameters only there).
    pool = {"mode": mode, "sync_every": 4} if mode == "local" else {}
    job = make_job(tmp_path, training={"steps": 400, "checkpoint_every": 100}, pool=pool)
    clock = _Told()
    recovery = Recovery(job, ReplicaClients(grpc_replicas(job, "job")), tmp_path, 300.0, clock)
    assert [s for s in range(1, 101) if recovery.due(s)] == [100]
    clock.t = 299.0
    assert not recovery.due(5)
    clock.t = 300.0
    assert recovery.due(5) == (mode == "step") and recovery.due(8)
    assert not Recovery(job, ReplicaClients(grpc_replicas(job, "job")), tmp_path).due(8)
    assert not Recovery(job, ReplicaClients(grpc_replicas(job, "job")), None, 1.0, clock).due(8)


async def test_a_trickling_member_fails_its_checkpoint_in_bounded_time_and_the_next_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # N12: a member sending a few bytes just inside rpc_timeout_s each kept the checkpoint in
    # progress forever, and every later one was skipped while it lasted.
    monkeypatch.setattr(state_streams, "STATE_MIN_RATE", 1 << 40)  # the floor is the deadline
    monkeypatch.setattr(state_streams, "STATE_FLOOR_S", 1.5)
    job = make_job(tmp_path, training={"stages": 1}, runtime={"rpc_timeout_s": 1.0})
    whole = initial_state(job, 0)
    trickle = HostileStage(lambda: whole.items(), step=2, chunk_bytes=8, pause_s=0.3)
    honest = HostileStage(lambda: whole.items(), step=4)
    directory = tmp_path / "checkpoints"
    clients = ReplicaClients(grpc_replicas(job, "job"))
    recovery = Recovery(job, clients, directory)
    loop = asyncio.get_running_loop()
    try:
        async with serving(trickle) as slow, serving(honest) as good:
            started = loop.time()
            recovery.checkpoint(2, [[Replica("peer-slow", slow)]])
            await asyncio.wait_for(recovery.flush(), 10)  # bounded: the old code read on
            assert loop.time() - started < 1.5 + 1.0 + 1.0
            recovery.checkpoint(4, [[Replica("peer-good", good)]])  # taken, not skipped
            await asyncio.wait_for(recovery.flush(), 10)
    finally:
        await clients.close()
    assert checkpoint.sealed(directory) == [4]
    told = [r.getMessage() for r in caplog.records]
    assert any("checkpoint 2: peer-slow did not answer" in m and "within 1.5s" in m for m in told)
    assert not any("skipped: the one before is still written" in m for m in told)


async def test_a_checkpoint_in_flight_as_a_peer_is_banned_is_never_sealed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A ban's rollback (`back_before(at_most)`) deletes the sealed checkpoints after the step
    it goes back to: they hold the banned peer's work. One still being written then held it
    too, and was sealed after the deletion: a scheduler restarted later resumed from it, the
    banned peer's work and all (CI: test_ban_restart, "rolled back to step 4" from a checkpoint
    of step 4 written after the rollback to step 0). Nor is one begun before the rollback loaded
    its state."""
    job = make_job(tmp_path, training={"stages": 1})
    whole = initial_state(job, 0)
    member = HostileStage(lambda: whole.items(), step=4)
    directory = tmp_path / "checkpoints"
    clients = ReplicaClients(grpc_replicas(job, "job"))
    recovery = Recovery(job, clients, directory)
    try:
        async with serving(member) as address:
            recovery.checkpoint(4, [[Replica("peer", address)]])  # of the steps before the ban
            assert await recovery.back_before(0) == 0  # the ban: back to step 0
            await asyncio.wait_for(recovery.flush(), 10)
            assert checkpoint.sealed(directory) == [], "sealed after the ban's deletion"
            assert checkpoint.latest(directory) is None
            # A step the old trajectory reached after the ban, before its rollback loaded step
            # 0's state (CI again: "checkpoint of step 6 written" after "rolled back to step
            # 0"): not checkpointed.
            member.step = 6
            recovery.checkpoint(6, [[Replica("peer", address)]])
            await asyncio.wait_for(recovery.flush(), 10)
            assert checkpoint.sealed(directory) == [], "the banned trajectory's step 6 sealed"
            await recovery.restore(0, [[]])  # the rollback loaded step 0 (here: on nobody)
            recovery.checkpoint(6, [[Replica("peer", address)]])  # step 6 trained anew
            await asyncio.wait_for(recovery.flush(), 10)
    finally:
        await clients.close()
    assert checkpoint.sealed(directory) == [6]
    told = [r.getMessage() for r in caplog.records]
    assert any("checkpoint of step 4 dropped" in m for m in told), told
    assert any("checkpoint of step 6 skipped: a ban's rollback to step 0" in m for m in told)


async def test_a_bans_deletions_run_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sealed checkpoints a ban's rollback deletes are whole models and their optimizers'
    state: deleted on the event loop, every job's calls and the embedded broker waited them out.
    Here a deletion takes 1 s: the loop goes on meanwhile (before, it was held the whole 1 s)."""
    job = make_job(tmp_path, training={"stages": 1})
    directory = tmp_path / "checkpoints"
    recovery = Recovery(job, ReplicaClients(grpc_replicas(job, "job")), directory)
    real = checkpoint.drop_after

    def slow(root: Path, step: int) -> list[int]:
        time.sleep(1.0)
        return real(root, step)

    monkeypatch.setattr(checkpoint, "drop_after", slow)
    gaps: list[float] = []

    async def ticking() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(ticking())
    await asyncio.sleep(0.05)
    try:
        assert await recovery.back_before(0) == 0
        await asyncio.sleep(0.05)  # the ticker's next tick, the gap it measures with it
    finally:
        ticker.cancel()
    assert gaps and max(gaps) < 0.5, f"the loop was held {max(gaps):.2f} s"


async def test_a_checkpoint_cancelled_mid_write_leaves_nothing_behind(tmp_path: Path) -> None:
    """A job cancelled (or a scheduler shut down) while its checkpoint is written: the stages
    already written were kept, in a step directory never sealed that nothing swept (each a
    model and its optimizer's state), until the job was deleted."""
    job = make_job(tmp_path, training={"stages": 2})
    fast = HostileStage(lambda: initial_state(job, 0).items(), step=10)
    slow = HostileStage(lambda: initial_state(job, 1).items(), step=10, pause_s=30.0)
    directory = tmp_path / "checkpoints"
    clients = ReplicaClients(grpc_replicas(job, "job"))
    recovery = Recovery(job, clients, directory)
    try:
        async with serving(fast) as a, serving(slow) as b:
            recovery.checkpoint(10, [[Replica("a", a)], [Replica("b", b)]])
            written = directory / "step-00000010" / "stage-0.safetensors"
            deadline = time.monotonic() + 20
            while not written.exists() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert written.exists(), "stage 0 was never written"
            await asyncio.wait_for(recovery.close(finished=False), 20)
    finally:
        await clients.close()
    assert not (directory / "step-00000010").exists()
    assert checkpoint.sealed(directory) == []


async def test_what_a_killed_write_left_is_swept_at_the_start(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    """A scheduler killed while a checkpoint was written left its step directory unsealed and
    its temporary files; nothing removed them (`prune` passes unsealed ones by). The job's
    coordinator removes them as it starts; the sealed ones stay."""
    job = make_job(tmp_path, training={"stages": 1})
    directory = tmp_path / "checkpoints"
    checkpoint.save_stage(directory, 2, 0, initial_state(job, 0))
    checkpoint.seal(directory, 2, 1)
    checkpoint.save_stage(directory, 4, 0, initial_state(job, 0))  # killed before its seal
    left = directory / "step-00000004" / ".stage-1.safetensors.4242.tmp"
    left.write_bytes(b"half a stage")
    stray = directory / "step-00000002" / ".stage-0.safetensors.4243.tmp"
    stray.write_bytes(b"a rewrite killed midway")
    swarm = FakeSwarm(fingerprint(job), 1)
    swarm.add(0, "a")
    h = make_harness(job, swarm, checkpoint_dir=directory)
    await h.coordinator.start()
    assert sorted(p.name for p in directory.iterdir()) == ["step-00000002"]
    assert not stray.exists() and checkpoint.sealed(directory) == [2]


async def test_a_checkpoint_not_written_is_said_in_the_jobs_status_once_until_one_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full checkpoint disk was said in the scheduler's log alone: `swarm status` said
    "training" for hours, and the first lost stage rolled the job back to step 0. It is said
    where status says it (once while the cause stays), and so is its end."""
    job = make_job(tmp_path, training={"stages": 1})
    whole = initial_state(job, 0)
    directory = tmp_path / "checkpoints"
    clients = ReplicaClients(grpc_replicas(job, "job"))
    told: list[str] = []
    recovery = Recovery(job, clients, directory, on_status=told.append)
    seal = checkpoint.seal

    def full(root: Path, step: int, *args: object) -> None:  # as a real one: it names the step
        raise checkpoint.CheckpointError(28, f"No space left on device: step-{step}/manifest")

    try:
        for step in (2, 4, 6):
            async with serving(HostileStage(lambda: whole.items(), step=step)) as address:
                monkeypatch.setattr(checkpoint, "seal", full if step < 6 else seal)
                recovery.checkpoint(step, [[Replica("peer-a", address)]])
                await asyncio.wait_for(recovery.flush(), 10)
        recovery.checkpoint(8, [[Replica("peer-a", "127.0.0.1:1")]])  # nobody answers
        await asyncio.wait_for(recovery.flush(), 10)
    finally:
        await clients.close()
    assert checkpoint.sealed(directory) == [6]
    assert len(told) == 3, told
    assert told[0].startswith("checkpoint of step 2 not written (") and "No space left" in told[0]
    assert "a rollback goes back to step 0" in told[0]
    assert told[1] == "checkpoints are written again: step 6's is sealed"
    assert told[2].startswith("checkpoint of step 8 not written (no replica of stage 0 gave its")


async def test_a_close_cancelled_while_it_flushes_still_ends_the_write(tmp_path: Path) -> None:
    """A job's last checkpoint is being written as the job ends; its close waits for it
    (`flush`), and a `swarm cancel` (or SIGTERM) then cancelled the close: the write went on
    after the job's task had ended, and DeleteJob or retention raced it (a review found it).
    The write is ended, and waited for, whatever cancels the close."""
    job = make_job(tmp_path, training={"stages": 1})
    recovery = Recovery(job, ReplicaClients(grpc_replicas(job, "job")), tmp_path)
    writing = asyncio.Event()
    recovery._saving = asyncio.create_task(writing.wait())  # a write under way, not ending
    closing = asyncio.create_task(recovery.close(finished=True))
    await asyncio.sleep(0.05)  # it waits for the write now
    closing.cancel()
    await asyncio.gather(closing, return_exceptions=True)
    assert closing.cancelled()
    assert recovery._saving.done(), "the write outlived the job's close"
