"""Leases in the field: a long poll instead of 20 ms polling, leases renewed while their work
runs, late receipts adopted instead of voiding their replica, and a remote trainer that rides out
a scheduler outage. The coordinator runs over in-memory replicas (`tests.support.replicas`) on a
`FakeClock`; the outage uses a real gRPC job API stopped and restarted on one port."""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from client.cli import add_arguments
from client.remote import RemoteCoordinator
from client.trainer import PipelineTrainer
from scheduler.coordinator import LocalCoordinator
from scheduler.coordinator.lease_signer import LeaseSigner
from scheduler.coordinator.ledger import StepLedger
from scheduler.store import JobStore
from swarm.clock import FakeClock
from swarm.errors import PeerUnavailable
from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.net.commit_auth import SchedulerKey
from swarm.rpc.lease import Lease, MicrobatchResult, Task, Working
from swarm.rpc.push_call import push_deadline_s
from tests.support.api import start_api
from tests.support.coordinator import LEASE_S, Harness, MakeHarness, job_of
from tests.support.jobs import BASE, make_job, render
from tests.support.ports import free_address
from tests.support.replicas import FakeReplica, FakeSwarm

pytestmark = pytest.mark.timeout(60)


async def _leased(c: LocalCoordinator, trainer: str = "t", count: int = 8) -> list[Task]:
    lease = await c.lease(trainer, count, wait_s=5.0)
    return lease.tasks


# -- renewals -----------------------------------------------------------------------------------
def test_a_renewed_lease_is_not_leased_again_however_long_its_work_takes() -> None:
    clock = FakeClock()
    ledger = StepLedger(step=0, microbatches=2, stages=2, lease_timeout_s=10, clock=clock)
    assert [t.index for t in ledger.lease("slow", 2)] == [0, 1]
    taken = []
    for _ in range(5):  # 40 s of work on microbatch 0, four times the lease timeout
        clock.advance(8)
        assert ledger.renew("slow", [0]) == [0]  # idempotent: renewing twice is renewing once
        assert ledger.renew("slow", [0]) == [0]
        taken += [t.index for t in ledger.lease("fast", 2)]
        ledger.renew("fast", taken)
    # Microbatch 1 was not renewed: it expired and went to "fast"; "slow" cannot take it back.
    assert taken == [1]
    assert ledger.renew("slow", [1]) == []
    clock.advance(11)  # "slow" stops renewing (it died): its microbatch goes to another
    assert [t.index for t in ledger.lease("other", 1)] == [0]


async def test_a_lease_renews_the_trainers_work_in_flight(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    job = job_of(tmp_path)
    swarm = FakeSwarm(fingerprint(job), 2)
    swarm.add(0, "a"), swarm.add(1, "c")
    h = make_harness(job, swarm)
    c, clock = h.coordinator, h.clock
    await c.start()
    assert [t.index for t in (await c.lease("A", 1)).tasks] == [0]
    for _ in range(4):  # A works on microbatch 0 for 4 lease timeouts, renewing it
        clock.advance(LEASE_S * 0.9)
        await c.lease("A", 0, working=[(0, 0)])
        assert [t.index for t in (await c.lease("B", 8)).tasks] in ([1], [])
    assert 0 not in [t.index for t in (await c.lease("B", 8)).tasks]
    await h.land(0, 0, {0: "a", 1: "c"}, trainer="A")  # A's work counts: no void
    assert not swarm["a"].called("discard")


# -- the long poll ------------------------------------------------------------------------------
class _Counting:
    """A `LeaseSource` that counts the lease calls made through it."""

    def __init__(self, inner: LocalCoordinator) -> None:
        self.inner, self.calls = inner, 0

    async def lease(self, trainer: str, count: int, **kwargs: Any) -> Lease:
        self.calls += 1
        return await self.inner.lease(trainer, count, **kwargs)

    async def report(self, trainer: str, result: MicrobatchResult) -> None:
        await self.inner.report(trainer, result)

    async def report_and_lease(
        self,
        trainer: str,
        results: Sequence[MicrobatchResult],
        count: int,
        *,
        working: Sequence[Working],
    ) -> Lease:
        self.calls += 1
        return await self.inner.report_and_lease(trainer, results, count, working=working)

    async def release(
        self, trainer: str, indices: Sequence[int], failure: str | None = None
    ) -> None:
        await self.inner.release(trainer, indices, failure)


async def test_an_idle_trainer_asks_a_handful_of_times_not_every_20ms(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    job = job_of(tmp_path)
    swarm = FakeSwarm(fingerprint(job), 2)
    a, _ = swarm.add(0, "a"), swarm.add(1, "c")
    gate = a.hold("prepare")  # the step's commit is in flight, held here: no work for anyone
    h = make_harness(job, swarm)
    c = h.coordinator
    await c.start()
    for task in (await c.lease("t", 8)).tasks:
        await h.land(0, task.index, {0: "a", 1: "c"})
    await asyncio.wait_for(gate.entered.wait(), 5)
    source = _Counting(c)
    trainer = PipelineTrainer(job, source)  # type: ignore[arg-type]
    run = asyncio.create_task(trainer.run())
    try:
        await asyncio.sleep(1.5)
        assert source.calls <= 3, f"{source.calls} lease calls in 1.5 s with no work"
    finally:
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        await trainer.close()


async def test_a_waiting_lease_answers_as_soon_as_work_appears(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    job = job_of(tmp_path)
    swarm = FakeSwarm(fingerprint(job), 2)
    a, _ = swarm.add(0, "a"), swarm.add(1, "c")
    gate = a.hold("prepare")
    h = make_harness(job, swarm)
    c = h.coordinator
    await c.start()
    for task in (await c.lease("t", 8)).tasks:
        await h.land(0, task.index, {0: "a", 1: "c"})
    await asyncio.wait_for(gate.entered.wait(), 5)
    waiting = asyncio.create_task(c.lease("t", 8, wait_s=30.0))
    await asyncio.sleep(0.3)
    assert not waiting.done()  # nothing to give while the commit is in flight: it waits
    started = time.monotonic()
    gate.open()  # the step commits, the next one opens
    lease = await asyncio.wait_for(waiting, 5)
    assert time.monotonic() - started < 1.0
    assert [(t.step, t.index) for t in lease.tasks] == [(1, 0), (1, 1)]
    # A released microbatch wakes a waiting lease too, and the last step's end says done.
    waiting = asyncio.create_task(c.lease("u", 8, wait_s=30.0))
    await asyncio.sleep(0.2)
    assert not waiting.done()
    await c.release("t", [1])
    assert [(t.step, t.index) for t in (await asyncio.wait_for(waiting, 5)).tasks] == [(1, 1)]


# -- fair shares --------------------------------------------------------------------------------
async def test_a_trainer_asking_again_and_again_leaves_a_waiting_trainer_its_share(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    """The scheduler's embedded trainer is in-process: with free slots it leases again at once,
    before a remote trainer's long poll can wake. A share is of the trainer's total holding, not
    of one call, so a trainer waiting for work still gets its half of the step."""
    training = {"stages": 2, "microbatch_size": 4, "target_batch_size": 16, "steps": 3}
    job = make_job(tmp_path, training=training, runtime={"lease_timeout_s": LEASE_S})
    swarm = FakeSwarm(fingerprint(job), 2)
    swarm.add(0, "a"), swarm.add(1, "c")
    h = make_harness(job, swarm)
    c, clock = h.coordinator, h.clock
    await c.start()
    assert (await c.lease("remote", 0)).tasks == []  # heard, holding no work
    embedded = [t.index for _ in range(4) for t in (await c.lease("embedded", 1)).tasks]
    assert len(embedded) == 2, embedded
    remote = [t.index for t in (await c.lease("remote", 8)).tasks]
    assert sorted(embedded + remote) == [0, 1, 2, 3]
    clock.advance(LEASE_S + 1)  # both went silent: every lease expired, no one is waiting
    assert len((await c.lease("embedded", 8)).tasks) == 4  # so one trainer takes the whole step


# -- late receipts ------------------------------------------------------------------------------
async def test_a_late_receipt_for_a_microbatch_still_needed_is_adopted(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    job = job_of(tmp_path)
    swarm = FakeSwarm(fingerprint(job), 2)
    a, b, c_ = swarm.add(0, "a"), swarm.add(0, "b"), swarm.add(1, "c")
    h = make_harness(job, swarm)
    c = h.coordinator
    await c.start()
    assert [t.index for t in await _leased(c)] == [0, 1]
    await h.land(0, 0, {0: "a", 1: "c"})
    # Microbatch 1: its Backward at stage 0 on b timed out at the trainer, which reported stage
    # 1 only; the Backward completed on b all the same.
    await h.land(0, 1, {1: "c"})
    b.accumulate(1)
    # The ledger still needs (1, stage 0) and b holds it: adopted, not replayed; the step
    # commits and the next lease is the next step's work.
    assert {t.step for t in await _leased(c, "u")} == {1}
    assert b.called("discard") == [] and a.called("discard") == []
    assert b.called("prepare")[-1].microbatches == [1]
    assert a.called("prepare")[-1].microbatches == [0]
    assert c_.called("prepare")[-1].microbatches == [0, 1]
    assert (a.step, b.step, c_.step) == (1, 1, 1)


async def test_every_lease_is_routed_around_a_refused_replica_until_its_step_is_applied(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    """A replica whose work of a step the norm bound refused (`StepLedger.route_around`) is in
    no lease's view until that step is applied, a lease with no task included (a trainer routes
    every hop by its last lease's view: a long poll that ran out, a renewal or a report's lease
    carried it back before, and a replay's next hop went to it); then it is back."""
    job = job_of(tmp_path)
    swarm = FakeSwarm(fingerprint(job), 2)
    swarm.add(0, "a"), swarm.add(0, "b"), swarm.add(1, "c")
    h = make_harness(job, swarm)
    c = h.coordinator
    await c.start()
    assert [t.index for t in await _leased(c)] == [0, 1]
    assert c.ledger is not None
    c.ledger.route_around(0, "b")

    def view(lease: Lease) -> list[list[str]]:
        return [[r.peer for r in stage] for stage in lease.replicas]

    assert view(await c.lease("u", 8)) == [["a"], ["c"]]  # nothing to lease: the view alone
    await h.land(0, 0, {0: "a", 1: "c"})
    await h.land(0, 1, {0: "a", 1: "c"})
    assert {t.step for t in await _leased(c, "u")} == {1}  # step 0 applied
    assert view(await c.lease("v", 8)) == [["a", "b"], ["c"]]


async def _stray_at_stage_1(
    job: JobConfig, make_harness: MakeHarness, signed: bool = False
) -> tuple[Harness, FakeReplica, FakeReplica, FakeReplica]:
    """Stage 0: a and b; stage 1: c alone. Microbatch 0 lands (a, c); microbatch 1 is given
    back with a receipt of it on c (its ForwardBackward at stage 1 landed, its hop at stage 0
    failed on every try), under run 0. `signed`: the tasks go out with the scheduler's tickets
    and runs, as a scheduler's coordinator signs them (a fake swarm's has no key). Returns
    (harness, a, b, c)."""
    swarm = FakeSwarm(fingerprint(job), 2)
    a, b, c_ = swarm.add(0, "a"), swarm.add(0, "b"), swarm.add(1, "c")
    h = make_harness(job, swarm)
    if signed:  # runs drawn: stage 0 has a second replica, and the pushes keep records
        h.coordinator._tickets = LeaseSigner(swarm.job_id, SchedulerKey.generate(), records=True)
    await h.coordinator.start()
    await _leased(h.coordinator)
    await h.land(0, 0, {0: "a", 1: "c"})
    c_.accumulate(1)
    await h.coordinator.release("t", [1])
    return h, a, b, c_


async def _voided_and_replayed_whole(
    h: Harness, a: FakeReplica, b: FakeReplica, c_: FakeReplica
) -> None:
    """After `_stray_at_stage_1`: c alone is voided before the replay goes out, what it held is
    replayed with the rest (both microbatches at stage 1, the given-back one at stage 0 too),
    and the step commits whole."""
    replay = await _leased(h.coordinator, "u")
    replay += await _leased(h.coordinator, "v")  # u's fair share is one of the two
    assert c_.called("discard") and not a.called("discard") and not b.called("discard")
    assert sorted((t.index, sorted(t.stages)) for t in replay) == [(0, [1]), (1, [0, 1])]
    await h.land(0, 0, {1: "c"}, trainer="u")
    await h.land(0, 1, {0: "b", 1: "c"}, trainer="v")
    for _ in range(500):
        if c_.step == 1:
            break
        await asyncio.sleep(0.01)
    assert (a.step, b.step, c_.step) == (1, 1, 1)
    assert c_.called("prepare")[-1].microbatches == [0, 1]


async def test_a_released_microbatchs_late_receipts_are_adopted_and_the_rest_replayed(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    h, a, b, c_ = await _stray_at_stage_1(job_of(tmp_path), make_harness)
    c = h.coordinator
    replay = await _leased(c, "u")
    assert replay == [Task(0, 1, frozenset({0}))]  # stage 1 adopted: stage 0 alone is replayed
    await h.land(0, 1, {0: "b"}, trainer="u")
    for _ in range(500):
        if a.step == 1:
            break
        await asyncio.sleep(0.01)
    assert (a.step, b.step, c_.step) == (1, 1, 1)
    assert not any(r.called("discard") for r in (a, b, c_))  # no replica voided
    assert c_.called("prepare")[-1].microbatches == [0, 1]


@pytest.mark.attack("late-receipt-run")
async def test_a_late_receipt_under_another_run_than_its_lease_voids_its_replica(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    # A member ahead on the route failed the honest hop, waited for the late-receipt check to
    # pass, then pushed the lessee's old run at c with inputs of its own; the replay (a new run)
    # was refused there (`StepSums.other_run`) and given back. Before, c's receipt was adopted
    # at the next check like an honest lost answer, and the stray stood. Now only a receipt
    # under the run of the lease given back is adopted: c is voided, its step there replayed.
    h, a, b, c_ = await _stray_at_stage_1(job_of(tmp_path), make_harness, signed=True)
    ledger = h.coordinator.ledger
    assert ledger is not None and ledger.run_of(1) not in (None, 0)  # the lease's own run
    assert c_.runs[1] == 0  # what c holds of microbatch 1 is another run's
    await _voided_and_replayed_whole(h, a, b, c_)


async def test_a_late_receipt_under_its_leases_run_is_adopted(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    """An honest answer lost on its way back: the receipt names the run of the lease given
    back, and is adopted as before (stage 1 is not replayed, nobody voided)."""
    h, a, b, c_ = await _stray_at_stage_1(job_of(tmp_path), make_harness, signed=True)
    ledger = h.coordinator.ledger
    assert ledger is not None
    run = ledger.run_of(1)
    assert run
    c_.runs[1] = run
    replay = await _leased(h.coordinator, "u")
    assert [(t.index, sorted(t.stages)) for t in replay] == [(1, [0])]  # stage 1 adopted
    assert not any(r.called("discard") for r in (a, b, c_))


async def _in_flight_at_stage_1(
    job: JobConfig, make_harness: MakeHarness, in_flight_run: int | None = None
) -> tuple[Harness, FakeReplica, FakeReplica, FakeReplica, int]:
    """As `_stray_at_stage_1`, signed, but c's push of microbatch 1 is still being computed as
    the microbatch is given back (an overloaded replica, its caller's deadline past): c names
    it in flight under `in_flight_run` (default: the lease's own run), with no receipt yet.
    Returns (harness, a, b, c, the lease's run)."""
    swarm = FakeSwarm(fingerprint(job), 2)
    a, b, c_ = swarm.add(0, "a"), swarm.add(0, "b"), swarm.add(1, "c")
    h = make_harness(job, swarm)
    h.coordinator._tickets = LeaseSigner(swarm.job_id, SchedulerKey.generate(), records=True)
    await h.coordinator.start()
    await _leased(h.coordinator)
    await h.land(0, 0, {0: "a", 1: "c"})
    ledger = h.coordinator.ledger
    assert ledger is not None
    run = ledger.run_of(1)
    assert run
    c_.flying = [(0, 1, run if in_flight_run is None else in_flight_run)]
    await h.coordinator.release("t", [1])
    return h, a, b, c_, run


async def test_a_microbatch_given_back_while_its_push_is_in_flight_waits_for_its_receipt(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    # Before, the check found no receipt and leased microbatch 1 again at once, under a new run;
    # c's push then accumulated under the old run, and the next check voided c (a receipt under
    # another run than its lease's): an honest, overloaded replica's step at stage 1 replayed.
    h, a, b, c_, run = await _in_flight_at_stage_1(job_of(tmp_path), make_harness)
    looked = len(c_.called("info"))
    assert (await h.coordinator.lease("u", 8, wait_s=1.5)).tasks == []  # checked, waited for
    assert len(c_.called("info")) >= looked + 2  # looked again while it waited, PACE_S apart
    # a stall's message says why no trainer holds it (before: "0 trainer(s) hold leases")
    assert "microbatch(es) [1] wait for their pushes still in flight" in h.coordinator.progress()
    c_.flying = []
    c_.accumulate(1, run)  # the push ended: its receipt, under the lease's run
    replay = await _leased(h.coordinator, "u")
    assert [(t.index, sorted(t.stages)) for t in replay] == [(1, [0])]  # stage 1 adopted
    assert not any(r.called("discard") for r in (a, b, c_))


@pytest.mark.attack("in-flight-forever")
async def test_a_push_named_in_flight_forever_holds_its_microbatch_only_for_its_deadline(
    tmp_path: Path, make_harness: MakeHarness, caplog: pytest.LogCaptureFixture
) -> None:
    """A replica that names a push in flight and never ends it (a hostile one) holds the
    microbatch up for the push's deadline (`rpc_timeout_s` a stage), once: then it is leased
    again."""
    job = job_of(tmp_path)
    h, _, _, c_, _ = await _in_flight_at_stage_1(job, make_harness)
    assert (await h.coordinator.lease("u", 8, wait_s=0.3)).tasks == []
    h.clock.advance(push_deadline_s(job) - 0.1)
    assert (await h.coordinator.lease("u", 8, wait_s=0.3)).tasks == []  # not yet
    h.clock.advance(0.1)
    replay = await _leased(h.coordinator, "u")
    assert [(t.index, sorted(t.stages)) for t in replay] == [(1, [0, 1])]
    assert "microbatch 1 is still being pushed at c (stage 1) after" in caplog.text
    assert c_.flying  # still named: the wait was once, not renewed by it


async def test_a_push_in_flight_under_another_run_is_not_waited_for(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    """A push of another run than the lease given back's is none of that lease's (a member
    ahead racing the replay): the microbatch goes out again at once."""
    h, *_ = await _in_flight_at_stage_1(job_of(tmp_path), make_harness, in_flight_run=12345)
    replay = await _leased(h.coordinator, "u")
    assert [(t.index, sorted(t.stages)) for t in replay] == [(1, [0, 1])]


@pytest.mark.attack("late-receipt-duplicate")
async def test_under_local_rounds_a_late_receipt_voids_its_replica_before_the_replay(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    # Local rounds never adopt a late receipt (it names no run for the route record). The
    # replay went to the stage again; landing on the replica holding the stray (here a pool of
    # one) it was answered as a duplicate (a replica accumulates a microbatch once a step), the
    # trainer reported that replica its holder, the receipts matched at the commit, and the
    # stray stood: a gradient of whoever pushed first, a member ahead on the route, say.
    settings = {"stages": 2, "microbatch_size": 4, "target_batch_size": 8, "steps": 3}
    runtime = {"lease_timeout_s": LEASE_S}
    pool = {"mode": "local", "sync_every": 2}
    job = make_job(tmp_path, training=settings, runtime=runtime, pool=pool)
    h, a, b, c_ = await _stray_at_stage_1(job, make_harness)  # the stray: c's receipt of 1
    # Stage 1 is not adopted: c is voided before the replay goes out (a replay landing there
    # would be answered as a duplicate and the stray kept), so what it held is replayed too.
    await _voided_and_replayed_whole(h, a, b, c_)


# -- a scheduler outage -------------------------------------------------------------------------
async def test_the_trainer_waits_for_a_scheduler_for_a_configurable_time() -> None:
    p = argparse.ArgumentParser()
    add_arguments("trainer", p)
    assert p.parse_args(["--job", "j"]).scheduler_retry_s >= 600  # a restart, an upgrade
    assert p.parse_args(["--job", "j", "--scheduler-retry-s", "5"]).scheduler_retry_s == 5.0
    remote = RemoteCoordinator("127.0.0.1:1", "j")
    assert remote.retry_for_s >= 600
    await remote.close()


@pytest.mark.slow  # a real scheduler's outage, waited out (~7 s)
async def test_a_remote_trainer_rides_out_a_scheduler_outage(tmp_path: Path) -> None:
    with JobStore(tmp_path / "jobs.db") as store:
        job_id = store.create("test", render(BASE), str(tmp_path), 3).id
    address = free_address()
    leases: list[tuple[str, int, float]] = []

    async def lease(job: str, trainer: str, count: int, **kw: Any) -> Lease:
        leases.append((trainer, count, kw.get("wait_s", 0.0)))
        return Lease(0, [Task(0, 0, frozenset({0}))], [])

    running = await start_api(tmp_path, address=address)
    running.control.lease = lease  # type: ignore[attr-defined]
    remote = RemoteCoordinator(address, job_id, timeout_s=1.0, retry_for_s=20.0)
    try:
        assert (await remote.lease("t", 2, wait_s=0.5)).tasks
        await running.stop()  # the scheduler goes down ...
        asked = asyncio.create_task(remote.lease("t", 2, wait_s=0.5))
        await asyncio.sleep(3.0)
        assert not asked.done()  # ... and the trainer keeps asking, backing off
        running = await start_api(tmp_path, address=address)  # ... and comes back
        running.control.lease = lease  # type: ignore[attr-defined]
        assert (await asyncio.wait_for(asked, 15)).tasks == [Task(0, 0, frozenset({0}))]
        assert leases[-1] == ("t", 2, 0.5)
        await running.stop()
        short = RemoteCoordinator(address, job_id, timeout_s=1.0, retry_for_s=1.0)
        started = time.monotonic()
        with pytest.raises(PeerUnavailable):  # past its patience, it gives up
            await short.lease("t", 2)
        assert time.monotonic() - started < 8
        await short.close()
    finally:
        await remote.close()
