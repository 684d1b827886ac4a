"""A rollback's state load retires the work leased before it (`swarm.rpc.epoch`).

Two rollbacks to step 0 within moments (a ban just after a first rollback reopened the step):
a trainer still runs a task of step 0 leased between them, through the peer about to be
banned. Its Backward lands at a replica after the second rollback loaded step 0's state again.
Accumulated, it was a gradient off the banned peer's path in the replayed step, and the replay's
own copy of the microbatch was answered as a duplicate: the model left `swarm local`'s (0.17 to
0.21 in the poison bench). A real stage server on a real port, driven as the trainer and the
coordinator drive it, in that order: no timing luck.

A replica that joins after the rollback loaded none of its state: the coordinator's Join tells it
the epoch, and it refuses the same stale work (before, it took it).

Its Info says the epoch of the state it holds, not of its last Join: a lost stage is taken up by
a peer whose Info says the job's step and an epoch no older than the last rollback's. A Join
raised the epoch long before its copy loaded, and a standby that missed a rollback's LoadState
and was Joined anew said the rollback's while holding the state from before it. Now the state's
epoch is set only with the state: by a rollback's LoadState, or by a loaded copy (the epoch of the
Join that began it, its source a member then), and a copy never follows its source across a
rollback (the source's update log is cleared as it loads)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from scheduler.coordinator import LocalCoordinator
from scheduler.coordinator.replicas import grpc_replicas
from stage_server.replica.runtime import StageRuntime
from stage_server.replica.step_sums import Sums
from stage_server.server import RunningStageServer, StageServerOptions, start_stage_server
from swarm.errors import FailedPrecondition, RemoteError, ResourceExhausted
from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.net.commit_auth import SchedulerKey
from swarm.proto import control_pb2 as cpb
from swarm.rpc import epoch
from swarm.rpc.lease import Lease, Task, lease_from_proto, lease_to_proto
from swarm.rpc.stage_client import StageClient
from swarm.wire.crossing import Crossing
from tests.support.inprocess import Swarm
from tests.support.jobs import make_job
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

BEFORE, AFTER = 5, 6  # the epochs a task was leased in: before the rollback and after it
MB = 3  # the microbatch of the step (its last: 4 a step) whose call comes across the rollback


@pytest.fixture
def job(tmp_path: Path) -> JobConfig:
    # The carry plane: the trainer's own Backward accumulates (on the push plane a replica the
    # scheduler placed accumulates only in a push: `swarm.net.lease_tickets`).
    return make_job(tmp_path, training={"stages": 3}, runtime={"data_plane": "relay"})


@pytest.fixture
async def server(job: JobConfig) -> AsyncIterator[RunningStageServer]:
    running = await start_stage_server(job, StageServerOptions(stage=1, metrics_port=0))
    yield running
    await running.stop()


async def test_a_backward_leased_before_a_rollback_is_refused_once_its_state_loads(
    job: JobConfig, server: RunningStageServer
) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 16, 32, dtype=torch.float64)
    stale, replayed = torch.randn_like(x), torch.randn_like(x)  # the banned path's, the replay's
    state = server.runtime.export_state()  # step 0's: what the rollback loads again
    client = StageClient(server.address, job, fingerprint(job), 1)
    try:
        epoch.leased_in(BEFORE)  # a task leased between the two rollbacks
        await client.forward(0, MB, Crossing(x))
        await client.load_state(0, state, rollback_epoch=AFTER)  # the second rollback
        with pytest.raises(FailedPrecondition, match="leased before a rollback"):
            await client.backward(0, MB, Crossing(x), stale)  # its Backward lands after the load
        assert server.runtime.receipts(0) == {}

        epoch.leased_in(AFTER)  # the replay of microbatch MB, leased after the rollback
        done = await client.backward(0, MB, Crossing(x), replayed)
        assert not done.receipt.duplicate
        assert server.runtime.receipts(0) == {MB: 4}
    finally:
        await client.close()
    # The step's sums are the replay's gradient alone: a replica that never saw the stale call
    # holds the same, bit for bit.
    alone = StageRuntime(job, 1)
    alone.load_state(0, state)
    alone.backward(0, MB, Crossing(x), replayed)
    held, expected = server.runtime.sums.accum_or_zeros(0), alone.sums.accum_or_zeros(0)
    assert all(torch.equal(a, b) for a, b in zip(held, expected, strict=True))


async def test_a_newer_epoch_in_a_call_retires_no_work(
    job: JobConfig, server: RunningStageServer
) -> None:
    """Only a rollback's LoadState (the scheduler's) moves a replica's epoch: on the push plane a
    peer names the epoch of the push it sends on, and a liar's far-off one must not have the
    replica refuse the honest work that follows."""
    x = torch.randn(4, 16, 32, dtype=torch.float64)
    client = StageClient(server.address, job, fingerprint(job), 1)
    try:
        epoch.leased_in(2**62)  # a liar's
        await client.backward(0, 1, Crossing(x), torch.ones_like(x))
        epoch.leased_in(BEFORE)  # the job's own, no rollback since
        await client.backward(0, 2, Crossing(x), torch.ones_like(x))
        assert server.runtime.receipts(0) == {1: 4, 2: 4}
    finally:
        await client.close()


def test_a_tasks_epoch_travels_with_its_lease() -> None:
    """A remote trainer's calls carry the epoch its lease said (tasks compare without it)."""
    task = Task(3, 1, frozenset({0, 1}), epoch=AFTER)
    (back,) = lease_from_proto(lease_to_proto(Lease(3, [task], []))).tasks
    assert back == task and back.epoch == AFTER


def _placed(server: RunningStageServer, job_id: str, key: SchedulerKey) -> None:
    """`server` as the scheduler placed it: it takes only the Joins the scheduler signed."""
    server.servicer.trust(cpb.JobAnnouncement(job=job_id, scheduler_key=key.public))


async def test_a_replica_that_joins_after_a_rollback_refuses_work_leased_before_it(
    job: JobConfig, make_swarm: list[Swarm]
) -> None:
    """The rollback loads its state on every member; a replica that comes after it copies a
    member, with no LoadState. A task leased before the rollback, still running, may pick the
    joiner (a trainer's retry, a push-plane replica's next hop): its Backward must be refused
    there as at the members."""
    job_id, key = fingerprint(job), SchedulerKey.generate()
    swarm = Swarm(job)
    make_swarm.append(swarm)
    await swarm.add_replicas(1)
    for (server,) in swarm.servers:
        _placed(server, job_id, key)
    rolled: asyncio.Queue[int] = asyncio.Queue()
    coordinator = LocalCoordinator(
        job,
        job_id,
        swarm.members,
        on_rollback=rolled.put_nowait,
        # the Join is signed, its epoch too, and each task's lease ticket
        connect=grpc_replicas(job, job_id, signing=key),
    )
    client: StageClient | None = None
    try:
        await coordinator.start()
        (stale,) = (await coordinator.lease("t", 1)).tasks  # leased before the rollback
        coordinator.bans.roll_back_to(0)  # a ban's: every member loads step 0's state again
        assert await asyncio.wait_for(rolled.get(), 30) == 0
        joiner = await swarm.add(1)
        _placed(joiner, job_id, key)
        await coordinator.membership.sync(0)  # the boundary: it copies the member of stage 1
        await wait_until(
            lambda: joiner.address in coordinator.membership.synced, "the joiner is a member"
        )
        (fresh,) = (await coordinator.lease("t", 1)).tasks  # the replay of the same microbatch
        assert (fresh.step, fresh.index) == (stale.step, stale.index)
        assert stale.epoch < fresh.epoch

        client = StageClient(joiner.address, job, job_id, 1)
        x = torch.randn(4, 16, 32, dtype=torch.float64)
        epoch.leased_in(stale.epoch, stale.tickets)  # its lease's own: refused all the same
        with pytest.raises(FailedPrecondition, match="leased before a rollback"):
            await client.backward(stale.step, stale.index, Crossing(x), torch.ones_like(x))
        assert joiner.runtime.receipts(0) == {}  # before: {0: 4}, the stale work in the step
        epoch.leased_in(fresh.epoch, fresh.tickets)
        await client.backward(fresh.step, fresh.index, Crossing(x), torch.ones_like(x))
        assert joiner.runtime.receipts(0) == {fresh.index: 4}
    finally:
        if client is not None:
            await client.close()
        await coordinator.close()


@pytest.mark.attack("M9")
async def test_only_the_schedulers_join_moves_a_replicas_epoch(
    job: JobConfig, server: RunningStageServer
) -> None:
    """A token holder's Join naming a far-off epoch (it would have the replica refuse all honest
    work) is refused before anything is done: only the scheduler signs Joins."""
    job_id, key = fingerprint(job), SchedulerKey.generate()
    _placed(server, job_id, key)
    client = StageClient(server.address, job, job_id, 1)
    x = torch.randn(4, 16, 32, dtype=torch.float64)
    try:
        with pytest.raises(RemoteError, match="UNAUTHENTICATED"):
            await client.join("127.0.0.1:1", 0, rollback_epoch=2**62)
        assert server.runtime.sums.epoch == 0
        epoch.leased_in(BEFORE, (b"", key.lease_ticket(job_id, 0, 1, BEFORE, 1)))  # its lease
        await client.backward(0, 1, Crossing(x), torch.ones_like(x))
        assert server.runtime.receipts(0) == {1: 4}
    finally:
        await client.close()


def test_a_join_sent_before_a_rollback_does_not_take_its_epoch_back() -> None:
    """A Join sent before a rollback may be handled after the rollback's LoadState: it raises
    the epoch, never lowers it."""
    sums = Sums([])
    sums.rolled_back(AFTER)
    sums.retire_before(BEFORE)
    with pytest.raises(FailedPrecondition, match="leased before a rollback"):
        sums.admit(BEFORE, 0, 1)
    sums.retire_before(AFTER + 1)  # a later Join's, after another rollback
    assert sums.epoch == AFTER + 1


async def test_a_join_sent_before_a_rollback_that_loaded_here_starts_no_copy(
    job: JobConfig, server: RunningStageServer
) -> None:
    """The coordinator's Join of the step before a rollback, handled after the rollback's
    LoadState here (the coordinator takes its new epoch once every member loaded): it named a
    source of the trajectory rolled back, maybe not loaded yet, whose state the copy would have
    installed over the rollback's (CI: test_ban_restart, "copied stage 0 at step 6" after
    "loaded stage 0's state of step 0", then every retrained microbatch refused as stale). It is
    refused, and no copy starts; a Join of the rollback's epoch starts one as ever."""
    client = StageClient(server.address, job, fingerprint(job), 1)
    try:
        await client.load_state(0, server.runtime.export_state(), rollback_epoch=AFTER)
        with pytest.raises(FailedPrecondition, match="sent before the rollback"):
            await client.join("127.0.0.1:1", 5, rollback_epoch=BEFORE)
        assert server.servicer._transfer.copy is None
        assert await client.join("127.0.0.1:1", 5, rollback_epoch=AFTER) == -1  # copying
        assert server.servicer._transfer.copy is not None
    finally:
        server.servicer._transfer.stop_copy()
        await client.close()


async def test_a_join_whose_copy_never_loads_leaves_the_states_epoch(
    job: JobConfig, server: RunningStageServer
) -> None:
    client = StageClient(server.address, job, fingerprint(job), 1)
    try:
        await client.load_state(0, server.runtime.export_state(), rollback_epoch=BEFORE)
        # A later rollback's Join, naming a source it cannot copy: nothing is loaded.
        assert await client.join("127.0.0.1:1", 0, rollback_epoch=AFTER) == -1
        info = await client.info()
        # Before: AFTER, while it held BEFORE's state (promotable as the rollback's).
        assert info.state_epoch == BEFORE
        # It still refuses work leased before the Join's epoch (it may become a member on it).
        assert server.runtime.sums.epoch == AFTER
    finally:
        server.servicer._transfer.stop_copy()
        await client.close()


async def test_a_loaded_copy_holds_its_joins_epoch_until_its_source_rolls_back(
    job: JobConfig, make_swarm: list[Swarm]
) -> None:
    swarm = Swarm(job)
    make_swarm.append(swarm)
    await swarm.add_replicas(1)
    source = swarm.servers[1][0]
    joiner = await swarm.add(1)
    client = StageClient(joiner.address, job, fingerprint(job), 1)
    to_source = StageClient(source.address, job, fingerprint(job), 1)
    transfer = joiner.servicer._transfer
    try:
        assert await client.join(source.address, 0, rollback_epoch=BEFORE) in (-1, 0)
        first = transfer.copy
        assert first is not None
        await wait_until(lambda: first.loaded, "the copy loads")
        assert (await client.info()).state_epoch == BEFORE
        # A newer epoch with no rollback (a scheduler restarted: its epoch is from the wall
        # clock): the copy goes on, its state the same (a download of minutes is not begun
        # again), and is said to be of the epoch it was copied in, older than it may be.
        await client.join(source.address, 0, rollback_epoch=AFTER)
        assert transfer.copy is first and first.running
        assert (await client.info()).state_epoch == BEFORE
        # A rollback: the source loads its state, and lets its followers go. The copy fails at
        # its next ask (it never follows a source across a rollback); the next Join begins
        # another, whose state is the rollback's.
        await to_source.load_state(0, source.runtime.export_state(), rollback_epoch=AFTER + 1)
        await wait_until(lambda: not first.running, "the copy from before the rollback ends")
        assert first.error is not None and "does not follow" in str(first.error)
        with pytest.raises(FailedPrecondition, match="does not follow"):  # said, and begun again
            await client.join(source.address, 0, rollback_epoch=AFTER + 1)
        again = transfer.copy
        assert again is not None and again is not first
        await wait_until(lambda: again.loaded, "the copy loads again")
        assert (await client.info()).state_epoch == AFTER + 1
    finally:
        transfer.stop_copy()
        await to_source.close()
        await client.close()


async def test_a_join_sent_before_a_rollback_is_refused_while_the_rollbacks_state_waits_to_load(
    job: JobConfig, server: RunningStageServer
) -> None:
    """The rollback's state is received and waits for the worker (a long call ahead of it); a
    Join sent before the rollback is handled meanwhile. It was let in (the epoch was raised as
    the state loaded), and its copy, of a source not loaded yet, would install the trajectory
    rolled back over the rollback's state."""
    worker, gate = server.servicer._transfer._worker, threading.Event()
    client = StageClient(server.address, job, fingerprint(job), 1)
    held = asyncio.ensure_future(worker.run(gate.wait))
    loading = asyncio.ensure_future(
        client.load_state(0, server.runtime.export_state(), rollback_epoch=AFTER)
    )
    try:
        await wait_until(lambda: worker.waiting == 2, "the state waits for the worker")
        with pytest.raises(FailedPrecondition, match="sent before the rollback"):
            await client.join("127.0.0.1:1", 0, rollback_epoch=BEFORE)
        assert server.servicer._transfer.copy is None
        gate.set()
        assert await loading == 0
        assert (await client.info()).state_epoch == AFTER
    finally:
        gate.set()
        await asyncio.gather(held, loading, return_exceptions=True)
        server.servicer._transfer.stop_copy()
        await client.close()


async def test_a_join_after_a_failed_copy_says_why_as_it_copies_again(
    job: JobConfig, server: RunningStageServer
) -> None:
    """A copy that failed was begun again by the next Join, which answered -1 as for any copy
    under way: the coordinator's status said "downloading state from X" for good, the cause
    in the joiner's log alone. The Join says it now (FAILED_PRECONDITION), the copy begun
    again all the same."""
    client = StageClient(server.address, job, fingerprint(job), 1)
    transfer = server.servicer._transfer
    try:
        assert await client.join("127.0.0.1:1", 0) == -1  # nothing listens there
        first = transfer.copy
        assert first is not None
        await wait_until(lambda: first.error is not None, "the copy fails")
        # kept without its frames (the state it downloaded, a load's tensors go with them)
        assert first.error is not None and first.error.__traceback__ is None
        with pytest.raises(FailedPrecondition, match=r"its copy of 127\.0\.0\.1:1 failed \("):
            await client.join("127.0.0.1:1", 0)
        again = transfer.copy
        assert again is not None and again is not first  # copying again
        # A source busy serving others (its places taken) is no failure to say: a standby's
        # failed asks are counted toward its replacement.
        await wait_until(lambda: again.error is not None, "the copy fails again")
        again.error = ResourceExhausted("4 state downloads are being served already")
        assert await client.join("127.0.0.1:1", 0) == -1
    finally:
        transfer.stop_copy()
        await client.close()
