"""Only a lease's holder accumulates: a replica the scheduler placed adds a microbatch's gradient
to its step's sums only from a call that carries the scheduler's lease ticket for that microbatch
at its stage (`swarm.net.lease_tickets`).

Before, any holder of the swarm token could send a `Backward` (or, at the last stage, a
`ForwardBackward`) with `accumulate` for any `(step, index)` and any epoch it liked. The replica
took the first accumulation of a microbatch and answered the honest one after it as a duplicate,
which no trainer reads: a finite gradient of the caller's replaced the honest microbatch's in the
step, and a NaN one failed another submitter's job (`NonFiniteStep`). Real stage servers on real
ports, driven as an outsider and as the lessee drive them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from client.trainer import PipelineTrainer
from scheduler.coordinator import LocalCoordinator, gather_state
from scheduler.coordinator.lease_signer import LeaseSigner
from scheduler.coordinator.replicas import grpc_replicas
from stage_server.replica.step_sums import Sums
from stage_server.server import RunningStageServer, StageServerOptions, start_stage_server
from swarm.deadline import within
from swarm.errors import Busy, PeerUnavailable, RemoteError
from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.net.commit_auth import SchedulerKey
from swarm.proto import control_pb2 as cpb
from swarm.proto import stage_pb2 as pb
from swarm.rpc import epoch
from swarm.rpc.lease import (
    ContributionAudit,
    Lease,
    Replica,
    Task,
    lease_from_proto,
    lease_to_proto,
)
from swarm.rpc.push_call import PushCall
from swarm.rpc.stage_client import StageClient, WirePush
from swarm.wire.crossing import Crossing
from tests.support.equality import assert_equal_to_local
from tests.support.inprocess import Swarm
from tests.support.jobs import make_job

pytestmark = pytest.mark.timeout(60)

EPOCH = 7  # the coordinator's, when the microbatch was leased
STEP, INDEX = 0, 1
REFUSED = r"PERMISSION_DENIED.*lease ticket"


def _job(tmp_path: Path, plane: str) -> JobConfig:
    return make_job(tmp_path, training={"stages": 3}, runtime={"data_plane": plane})


@pytest.fixture
def relay(tmp_path: Path) -> JobConfig:
    """The carry plane's: the trainer sends each stage's Backward itself."""
    return _job(tmp_path, "relay")


async def _server(job: JobConfig, stage: int) -> RunningStageServer:
    return await start_stage_server(job, StageServerOptions(stage=stage, metrics_port=0))


@pytest.fixture
async def middle(relay: JobConfig) -> AsyncIterator[RunningStageServer]:
    running = await _server(relay, 1)
    yield running
    await running.stop()


def _placed(server: RunningStageServer, job_id: str, key: SchedulerKey) -> None:
    """`server` as the scheduler placed it: it knows the scheduler's key."""
    server.servicer.trust(cpb.JobAnnouncement(job=job_id, scheduler_key=key.public))


def _x() -> torch.Tensor:
    return torch.randn(4, 16, 32, dtype=torch.float64)


def _lease(*tickets: bytes) -> None:
    """The current task's lease: its epoch, and its tickets by stage."""
    epoch.leased_in(EPOCH, tickets)


@pytest.mark.attack("lease-ticket")
async def test_a_placed_replica_accumulates_only_with_its_stages_ticket(
    relay: JobConfig, middle: RunningStageServer
) -> None:
    job_id, key = fingerprint(relay), SchedulerKey.generate()
    _placed(middle, job_id, key)
    x = _x()
    poison = torch.full_like(x, float("nan"))
    own = key.lease_ticket(job_id, STEP, INDEX, EPOCH, 1)
    client = StageClient(middle.address, relay, job_id, 1)
    try:
        wrong = {
            "no ticket (an outsider's)": b"",
            "another stage's": key.lease_ticket(job_id, STEP, INDEX, EPOCH, 2),
            "another microbatch's": key.lease_ticket(job_id, STEP, INDEX + 1, EPOCH, 1),
            "another step's": key.lease_ticket(job_id, STEP + 1, INDEX, EPOCH, 1),
            "another epoch's": key.lease_ticket(job_id, STEP, INDEX, EPOCH + 1, 1),
            "another job's": key.lease_ticket("other-job", STEP, INDEX, EPOCH, 1),
            "another key's": SchedulerKey.generate().lease_ticket(job_id, STEP, INDEX, EPOCH, 1),
            "a malformed one": own[:-1],
        }
        for what, ticket in wrong.items():
            _lease(b"", ticket)
            with pytest.raises(RemoteError, match=REFUSED):
                await client.backward(STEP, INDEX, Crossing(x), poison)
            assert middle.runtime.receipts(STEP) == {}, what
        # Stage 2's ticket sent as stage 1's (a stage after this one learns only its own).
        _lease(b"", key.lease_ticket(job_id, STEP, INDEX, EPOCH, 2))
        with pytest.raises(RemoteError, match=REFUSED):
            await client.backward(STEP, INDEX, Crossing(x), poison)
        # An audit's re-execution adds nothing to the sums: it needs no ticket.
        _lease()
        await client.backward(STEP, INDEX, Crossing(x), torch.ones_like(x), accumulate=False)
        assert middle.runtime.receipts(STEP) == {}

        _lease(b"", own)  # the lessee's
        done = await client.backward(STEP, INDEX, Crossing(x), torch.ones_like(x))
        assert not done.receipt.duplicate
        assert middle.runtime.receipts(STEP) == {INDEX: 4}
    finally:
        await client.close()


def test_only_an_accumulating_call_carries_its_stages_ticket() -> None:
    """A Forward, or an audit's re-execution, tells its replica nothing that would let it
    accumulate the microbatch at another stage, nor at its own elsewhere."""
    epoch.leased_in(EPOCH, (b"a" * 64, b"b" * 64, b""))
    assert epoch.microbatch_id(STEP, INDEX).ticket == b""  # not accumulating
    assert epoch.microbatch_id(STEP, INDEX, 1).ticket == b"b" * 64
    assert epoch.microbatch_id(STEP, INDEX, 2).ticket == b""  # none for that stage
    assert epoch.microbatch_id(STEP, INDEX, 5).ticket == b""  # past the task's stages
    assert epoch.microbatch_id(STEP, INDEX, 1).epoch == EPOCH


@pytest.mark.attack("lease-ticket")
async def test_the_last_stage_takes_a_forward_backward_only_with_its_ticket(
    relay: JobConfig,
) -> None:
    job_id, key = fingerprint(relay), SchedulerKey.generate()
    last = await _server(relay, 2)
    _placed(last, job_id, key)
    targets = torch.randint(0, relay.model.vocab_size, (4, 16))
    client = StageClient(last.address, relay, job_id, 2)
    try:
        _lease()
        with pytest.raises(RemoteError, match=REFUSED):
            await client.forward_backward(STEP, INDEX, Crossing(_x()), targets)
        assert last.runtime.receipts(STEP) == {}
        _lease(b"", b"", key.lease_ticket(job_id, STEP, INDEX, EPOCH, 2))
        await client.forward_backward(STEP, INDEX, Crossing(_x()), targets)
        assert last.runtime.receipts(STEP) == {INDEX: 4}
    finally:
        await client.close()
        await last.stop()


@pytest.mark.attack("lease-ticket")
async def test_on_the_push_plane_only_a_push_accumulates(tmp_path: Path) -> None:
    """A push-plane stage accumulates in the push that did its forward: a Backward with its
    ticket (a replica earlier on the push's route has seen it) is refused all the same."""
    job = _job(tmp_path, "push")
    job_id, key = fingerprint(job), SchedulerKey.generate()
    server = await _server(job, 1)
    _placed(server, job_id, key)
    x = _x()
    client = StageClient(server.address, job, job_id, 1)
    try:
        _lease(b"", key.lease_ticket(job_id, STEP, INDEX, EPOCH, 1))
        with pytest.raises(RemoteError, match=r"PERMISSION_DENIED.*only in the push"):
            await client.backward(STEP, INDEX, Crossing(x), torch.ones_like(x))
        assert server.runtime.receipts(STEP) == {}
        await client.backward(STEP, INDEX, Crossing(x), torch.ones_like(x), accumulate=False)
    finally:
        await client.close()
        await server.stop()


async def test_a_replica_no_scheduler_placed_takes_the_token_alone(
    relay: JobConfig, middle: RunningStageServer
) -> None:
    """`swarm trainer --stage-servers`: its owner coordinates, and no scheduler signs leases."""
    x = _x()
    client = StageClient(middle.address, relay, fingerprint(relay), 1)
    try:
        _lease()
        await client.backward(STEP, INDEX, Crossing(x), torch.ones_like(x))
        assert middle.runtime.receipts(STEP) == {INDEX: 4}
    finally:
        await client.close()


def test_a_tasks_tickets_travel_with_its_lease() -> None:
    """A remote trainer's calls carry the tickets its lease gave (tasks compare without them)."""
    tickets = (b"", b"t" * 64)
    task = Task(3, 1, frozenset({1}), epoch=EPOCH, tickets=tickets, run=RUN)
    (back,) = lease_from_proto(lease_to_proto(Lease(3, [task], []))).tasks
    assert back == task and back.tickets == tickets and back.run == RUN


def test_each_stage_a_task_accumulates_at_gets_its_ticket_and_no_other() -> None:
    key = SchedulerKey.generate()
    replay = Task(STEP, INDEX, frozenset({0, 2}), epoch=EPOCH)  # a replay of two stages
    (unsigned,) = LeaseSigner("job", None).signed([replay])
    assert unsigned.tickets == ()  # no scheduler: nothing to sign with
    evaluation = Task(STEP, 9, frozenset(), evaluate=True, epoch=EPOCH)
    signed, checked = LeaseSigner("job", key).signed([replay, evaluation])
    assert signed.tickets == (
        key.lease_ticket("job", STEP, INDEX, EPOCH, 0),
        b"",
        key.lease_ticket("job", STEP, INDEX, EPOCH, 2),
    )
    assert checked.tickets == ()  # a validation microbatch accumulates nothing


def test_a_push_planes_task_is_leased_with_a_run_its_tickets_name() -> None:
    """Drawn where the job's pushes keep records (push plane, audited) and some stage has a
    second replica to redo its work; else 0, and no replica keeps a record."""
    key, task = SchedulerKey.generate(), Task(STEP, INDEX, frozenset({0, 1}), epoch=EPOCH)
    one, two = [Replica("a", "a:1")], [Replica("b", "b:1"), Replica("c", "c:1")]
    (drawn,) = LeaseSigner("job", key, records=True).signed([task], [one, two])
    (again,) = LeaseSigner("job", key, records=True).signed([task], [one, two])
    assert drawn.run != 0 and again.run != drawn.run  # each lease its own
    assert drawn.tickets == tuple(
        key.lease_ticket("job", STEP, INDEX, EPOCH, k, drawn.run) for k in (0, 1)
    )
    for signer, members in (
        (LeaseSigner("job", key, records=True), [one, one]),  # nothing could redo a stage
        (LeaseSigner("job", key, records=False), [one, two]),  # the carry plane, or no audits
    ):
        (plain,) = signer.signed([task], members)
        assert plain.run == 0
        assert plain.tickets[1] == key.lease_ticket("job", STEP, INDEX, EPOCH, 1, 0)
    # A task carrying a contribution's audit keeps records, as the trainer's own choice did
    audited = Task(STEP, INDEX, frozenset({0, 1}), audits=(ContributionAudit(1, "c", 9),))
    (kept,) = LeaseSigner("job", key, records=True).signed([audited], [one, one])
    assert kept.run != 0


@pytest.mark.parametrize("plane", ["push", "relay"])
async def test_a_swarm_the_scheduler_placed_trains_exactly_on_its_leases(
    tmp_path: Path, make_swarm: list[Swarm], plane: str
) -> None:
    """Every accumulation of a real training run carries its ticket: the coordinator signs each
    task, the trainer sends each stage its own, a push passes them on along its route."""
    job = make_job(tmp_path, training={"stages": 3, "steps": 3}, runtime={"data_plane": plane})
    job_id, key = fingerprint(job), SchedulerKey.generate()
    swarm = Swarm(job)
    make_swarm.append(swarm)
    await swarm.add_replicas(2)
    for stage in swarm.servers:
        for server in stage:
            _placed(server, job_id, key)
    coordinator = LocalCoordinator(
        job, job_id, swarm.members, connect=grpc_replicas(job, job_id, signing=key)
    )
    try:
        await swarm.train(coordinator)
        assert_equal_to_local(job, await gather_state(coordinator), tol=1e-9)
    finally:
        await coordinator.close()


def test_a_push_carries_on_only_the_tickets_of_the_stages_it_accumulates_at() -> None:
    """An onward push accumulates at the later stages only: no replica it goes through learns
    an earlier stage's ticket (with it, a hostile stage 2 could accumulate ahead of the honest
    stage 0's backward, which waits for stage 2's answer)."""
    t0, t1, t2 = b"0" * 64, b"1" * 64, b"2" * 64
    epoch.leased_in(EPOCH, (t0, t1, t2))
    assert epoch.push_tickets((0, 1, 2)) == [t0, t1, t2]  # the trainer's, to stage 0
    assert epoch.push_tickets((1, 2)) == [b"", t1, t2]  # stage 0's push on to stage 1
    assert epoch.push_tickets((2,)) == [b"", b"", t2]
    assert epoch.push_tickets(()) == []  # a try that may have landed accumulates nowhere
    epoch.leased_in(EPOCH, (b"", t1))  # a replay of stage 1 alone
    assert epoch.push_tickets((1, 2)) == [b"", t1]


@pytest.mark.attack("lease-ticket")
async def test_a_push_that_accumulates_without_its_ticket_is_refused_on_arrival(
    tmp_path: Path,
) -> None:
    """Before any of its path's compute: not at its backward, after the forward here and the
    push on (its next stage here is gone: a refusal after the forward would say so)."""
    job = _job(tmp_path, "push")
    job_id, key = fingerprint(job), SchedulerKey.generate()
    server = await _server(job, 1)
    _placed(server, job_id, key)
    x = _x()
    targets = torch.zeros(4, 16, dtype=torch.long)
    route = (pb.Route(peers=["gone"], addresses=["127.0.0.1:1"]),)
    call: WirePush = PushCall(STEP, INDEX, Crossing(x), targets, accumulate=(1, 2), route=route)
    client = StageClient(server.address, job, job_id, 1)
    try:
        _lease()
        with pytest.raises(RemoteError, match=REFUSED):
            await client.push(call, timeout=30)
        _lease(b"", b"", key.lease_ticket(job_id, STEP, INDEX, EPOCH, 2))  # stage 2's only
        with pytest.raises(RemoteError, match=REFUSED):
            await client.push(call, timeout=30)
        # With its own ticket it is taken, and fails where it goes on: its next stage is gone.
        _lease(b"", key.lease_ticket(job_id, STEP, INDEX, EPOCH, 1))
        with pytest.raises(PeerUnavailable):
            await client.push(call, timeout=30)
    finally:
        await client.close()
        await server.stop()


RUN = 0x7A11  # the run the coordinator leased the microbatch under (`Task.run`)


@pytest.mark.attack("lease-run")
async def test_a_push_accumulates_only_under_the_run_its_ticket_names(tmp_path: Path) -> None:
    """A replica earlier on a push's route holds a later stage's ticket: before, it could push
    the microbatch there itself under a run of its own, ahead of the honest push, which was then
    answered as a duplicate and read as the lessee's. That replica's record of the honest run
    was not what it accumulated, and its contribution's audit, redone from that run's records,
    framed it. Now the ticket names the run too: only the lessee's run accumulates."""
    job = make_job(tmp_path, training={"stages": 2}, runtime={"data_plane": "push"})
    job_id, key = fingerprint(job), SchedulerKey.generate()
    last = await _server(job, 1)
    _placed(last, job_id, key)
    x = _x()
    targets = torch.randint(0, job.model.vocab_size, (4, 16))
    client = StageClient(last.address, job, job_id, 1)
    try:
        _lease(b"", key.lease_ticket(job_id, STEP, INDEX, EPOCH, 1, RUN))
        for run in (RUN + 2, 0):  # another run; none (a push that keeps no record)
            raced: WirePush = PushCall(STEP, INDEX, Crossing(x), targets, (1,), run=run)
            with pytest.raises(RemoteError, match=REFUSED):
                await client.push(raced, timeout=30)
            assert last.runtime.receipts(STEP) == {}
        honest: WirePush = PushCall(STEP, INDEX, Crossing(x), targets, (1,), run=RUN)
        pushed = await client.push(honest, timeout=30)
        assert [r.duplicate for r in pushed.receipts] == [False]
        assert last.runtime.receipts(STEP) == {INDEX: 4}
    finally:
        await client.close()
        await last.stop()


@pytest.mark.attack("late-receipt-run")
async def test_a_push_under_another_run_than_the_held_one_is_refused_not_a_duplicate(
    tmp_path: Path,
) -> None:
    """A member ahead on the route holds this stage's ticket of the lessee's run: it can fail
    the honest hop, wait for the coordinator's late-receipt check to pass, then push that old
    run here with inputs of its own. Before, the replay (a new run, its own ticket) was answered
    as a duplicate, the trainer reported this replica its holder, and the stray stood. Now the
    replica keeps each receipt's run, refuses an accumulating push under another (Busy at its
    header: the caller tries another replica), and Info names the runs for the coordinator's
    check, which adopts only a receipt under the run of the lease given back."""
    job = make_job(tmp_path, training={"stages": 2}, runtime={"data_plane": "push"})
    job_id, key = fingerprint(job), SchedulerKey.generate()
    last = await _server(job, 1)
    _placed(last, job_id, key)
    targets = torch.randint(0, job.model.vocab_size, (4, 16))
    client = StageClient(last.address, job, job_id, 1)
    replay = RUN + 2
    try:
        _lease(b"", key.lease_ticket(job_id, STEP, INDEX, EPOCH, 1, RUN))
        stray: WirePush = PushCall(STEP, INDEX, Crossing(_x()), targets, (1,), run=RUN)
        assert [r.duplicate for r in (await client.push(stray, timeout=30)).receipts] == [False]
        info = await client.info()
        assert (list(info.receipts), list(info.receipt_runs)) == ([INDEX], [RUN])
        _lease(b"", key.lease_ticket(job_id, STEP, INDEX, EPOCH, 1, replay))
        honest: WirePush = PushCall(STEP, INDEX, Crossing(_x()), targets, (1,), run=replay)
        with pytest.raises(Busy, match=f"held here under run {RUN}, not run {replay}"):
            await client.push(honest, timeout=30)
        info = await client.info()  # what it holds is the first push's, named by its run
        assert (list(info.receipts), list(info.receipt_runs)) == ([INDEX], [RUN])
    finally:
        await client.close()
        await last.stop()


def test_the_worker_refuses_another_run_too_where_the_header_looked_first() -> None:
    """Two pushes of one microbatch under different runs may both pass the header's look
    before either accumulates: the worker's own look, as it accumulates, refuses the second
    (`StepSums.other_run`; FailedPrecondition there, since the body was read by then)."""
    sums = Sums([torch.zeros(2)])
    sums.check_run(STEP, INDEX, RUN)  # nothing held of the step
    held = sums.of(STEP)
    held.received(INDEX, 4, RUN)
    assert held.other_run(INDEX, RUN) is None  # the same run: a duplicate, answered as one
    assert held.other_run(INDEX + 1, RUN + 2) is None  # nothing held of it
    assert held.other_run(INDEX, RUN + 2) == RUN
    with pytest.raises(Busy, match=f"under run {RUN}, not run {RUN + 2}"):
        sums.check_run(STEP, INDEX, RUN + 2)
    assert held.withdraw() == [INDEX] and held.runs == {}


@pytest.mark.attack("late-receipt-run")
@pytest.mark.timeout(180)  # its recovery goes through the hops' backoffs: a busy machine's too
async def test_a_members_stray_after_the_check_is_voided_and_the_job_stays_exact(
    tmp_path: Path, make_swarm: list[Swarm], caplog: pytest.LogCaptureFixture
) -> None:
    """The race end to end, on real stage servers the scheduler placed: a member ahead on the
    route (here the test, holding the lessee's tickets) fails the honest pushes of step 0, waits
    for the late-receipt check to pass, then pushes one of them at the last stage, a pool of one,
    under the lessee's old run with inputs of its own. The replay under a new run is refused
    there, given back, and the replica voided by the next check: the job ends at `swarm
    local`'s parameters. Before, the replay was answered as a duplicate, the trainer reported
    that replica its holder, and the stray gradient stood in step 0."""
    job = make_job(
        tmp_path,
        training={"stages": 3, "steps": 2},
        runtime={"data_plane": "push"},
        trust={"audit_fraction": 0.5},  # audited, as by default: pushes keep records
    )
    job_id, key = fingerprint(job), SchedulerKey.generate()
    swarm = Swarm(job)
    make_swarm.append(swarm)
    await swarm.add_replicas(1)
    await swarm.add(0)  # and a second replica somewhere: runs are drawn (`LeaseSigner`)
    for stage in swarm.servers:
        for server in stage:
            _placed(server, job_id, key)
    coordinator = LocalCoordinator(
        job, job_id, swarm.members, connect=grpc_replicas(job, job_id, signing=key)
    )
    last = swarm.servers[2][0]
    client = StageClient(last.address, job, job_id, 2)
    trainer = PipelineTrainer(job, coordinator, seed=0)
    try:
        await coordinator.start()
        tasks = (await coordinator.lease("member", 64)).tasks
        stray = next(t for t in tasks if 2 in t.stages and not t.evaluate)
        assert stray.run and stray.tickets[2]
        await coordinator.release("member", [t.index for t in tasks])  # every hop "failed"
        await coordinator.lease("member", 0)  # the check runs: nothing held anywhere
        ledger = coordinator.ledger
        assert ledger is not None
        for _ in range(200):
            if not ledger.returned():
                break
            await asyncio.sleep(0.05)
        assert not ledger.returned(), "the late-receipt check did not pass"
        epoch.leased_in(stray.epoch, stray.tickets)
        targets = torch.randint(0, job.model.vocab_size, (4, 16))
        own: WirePush = PushCall(0, stray.index, Crossing(_x()), targets, (2,), run=stray.run)
        assert [r.duplicate for r in (await client.push(own, timeout=30)).receipts] == [False]
        await within(asyncio.gather(trainer.run(), coordinator.finished.wait()), 120)
        assert coordinator.error is None
        assert_equal_to_local(job, await gather_state(coordinator), tol=1e-9)
        # how: the replay refused there, the replica voided at the check, by its receipt's run
        assert f"late receipts [{stray.index}] at stage 2 under another run" in caplog.text
    finally:
        await trainer.close()
        await client.close()
        await coordinator.close()
