"""`pool.mode = "local"` at the coordinator, against in-memory replicas: each replica's local step
over its own samples, the rounds' two phases, a member that fails a round (dropped, its round's
samples counted and said), joins only where a round starts, and the route record."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from swarm.errors import PeerUnavailable
from swarm.job.fingerprint import fingerprint
from swarm.model.local_steps import train_replicas
from swarm.model.routes import Join, Record, Resume, StepRuns, Sync
from swarm.proto import stage_pb2 as pb
from swarm.proto import stage_pb2_grpc
from swarm.rpc.lease import Task
from tests.support.coordinator import LEASE_S, Harness, MakeHarness, until
from tests.support.hostile import serving
from tests.support.jobs import make_job
from tests.support.replicas import FakeReplica, FakeSwarm, Prepared

pytestmark = pytest.mark.timeout(60)


def _local(tmp_path: Path, steps: int = 4, overlap: str = "none") -> object:
    training = {
        "stages": 2,
        "microbatch_size": 4,
        "target_batch_size": 8,
        "steps": steps,
        "checkpoint_every": 0,
    }
    runtime = {"lease_timeout_s": LEASE_S, "data_plane": "relay"}
    pool = {"mode": "local", "sync_every": 2, "overlap": overlap}
    return make_job(tmp_path, training=training, runtime=runtime, pool=pool)


def _pools(
    job: object, make_harness: MakeHarness
) -> tuple[FakeSwarm, Harness, list[Record], list[str]]:
    """Stage 0 of a and b, stage 1 of c; the harness records the routes and what it says."""
    swarm = FakeSwarm(fingerprint(job), 2)  # type: ignore[arg-type]
    swarm.add(0, "a"), swarm.add(0, "b"), swarm.add(1, "c")
    records: list[Record] = []
    said: list[str] = []
    h = make_harness(job, swarm, on_route=records.append, on_status=said.append)  # type: ignore[arg-type]
    return swarm, h, records, said


async def test_local_steps_commit_alone_and_rounds_average_the_pool(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    job = _local(tmp_path)
    swarm, h, records, said = _pools(job, make_harness)
    a, b, c = swarm["a"], swarm["b"], swarm["c"]
    await h.coordinator.start()
    await h.step({0: "a"})  # microbatch 0 at a, 1 at a: b took none in step 0
    assert a.called("prepare") == [Prepared(0, [0, 1], 8, ["fake:a"], 0, "0/0")]
    assert b.called("prepare") == [Prepared(0, [], 0, ["fake:b"], 0, "0/0")]
    assert not a.called("prepare_round")
    tasks = await h.lease()
    await h.run(tasks[0], {0: "a"})
    await h.run(tasks[1], {0: "b"})
    await asyncio.wait_for(h.steps.get(), 10)
    # The round after step 1: a took 12 samples, b 4; the group weighs them together.
    assert a.called("prepare_round") == [(2, 16, ["fake:a", "fake:b"], "1/round0")]
    assert b.called("prepare_round") == [(2, 16, ["fake:a", "fake:b"], "1/round0")]
    assert c.called("prepare_round") == [(2, 16, ["fake:c"], "1/round0")]
    phases = [m for _, m in swarm.log if m in ("prepare_round", "apply_round")]
    assert phases == ["prepare_round"] * 3 + ["apply_round"] * 3
    # b fails the next round: it is dropped, the round repeats without it, its samples counted.
    b.fail("prepare_round", PeerUnavailable("b died"))
    await h.step({0: "b"})
    await h.step({0: "b"})
    assert a.called("prepare_round")[-1] == (4, 0, ["fake:a"], "3/round1")
    assert h.coordinator.metrics.round_dropped._value.get() == 16
    assert said and "stage 0: b left mid-round, 16 samples dropped" in said[-1]
    joins = [(r.step, r.stage, r.peer, r.source) for r in records if isinstance(r, Join)]
    assert joins == [(0, 0, "a", None), (0, 0, "b", None), (0, 1, "c", None)]
    syncs = [(r.step, r.stage, r.group) for r in records if isinstance(r, Sync)]
    assert syncs == [(1, 0, ("a", "b")), (1, 1, ("c",)), (3, 0, ("a",)), (3, 1, ("c",))]
    runs = [r for r in records if isinstance(r, StepRuns)]
    assert [r.step for r in runs] == [0, 1, 2, 3]


async def test_a_copy_joins_only_where_a_round_starts(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    job = _local(tmp_path, steps=6)
    swarm = FakeSwarm(fingerprint(job), 2)  # type: ignore[arg-type]
    swarm.add(0, "a"), swarm.add(1, "c")
    records: list[Record] = []
    h = make_harness(job, swarm, on_route=records.append)  # type: ignore[arg-type]
    await h.coordinator.start()
    tasks = await h.lease()
    swarm.add(0, "b", step=0)  # comes during step 0: it copies a from step 1 on, mid-round
    for task in tasks:
        await h.run(task)
    await asyncio.wait_for(h.steps.get(), 10)
    await until(lambda: swarm["b"].called("join") != [])
    assert "b" not in {r.peer for r in h.coordinator.replicas()[0]}
    await h.step()
    await until(lambda: "b" in {r.peer for r in h.coordinator.replicas()[0]})
    joins = [(r.step, r.stage, r.peer, r.source) for r in records if isinstance(r, Join)]
    assert joins[-1] == (2, 0, "b", "a")


async def test_eager_rounds_sum_while_the_next_round_trains(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    """pool.overlap = "eager": a round's end is every member's outer step (EAGER_STEP) and no
    wait: while the pools' sum of the shares (EAGER_AVERAGE) is held, the next round's steps
    commit; the round's end after them waits for that sum; the job's last round is waited for
    (EAGER_LAST's two phases) and ends with the members' mean (EAGER_MEAN)."""
    job = _local(tmp_path, steps=6, overlap="eager")
    swarm = FakeSwarm(fingerprint(job), 2)  # type: ignore[arg-type]
    a, b, c = swarm.add(0, "a"), swarm.add(0, "b"), swarm.add(1, "c")
    records: list[Record] = []
    h = make_harness(job, swarm, on_route=records.append)  # type: ignore[arg-type]
    held = a.hold("eager_average")
    await h.coordinator.start()
    await h.step({0: "a"})
    await h.step({0: "b"})  # round [0, 1] ends: a took 8 samples, b 8
    await asyncio.wait_for(held.entered.wait(), 10)
    eager = [m for _, m in swarm.log if m.startswith("eager")]
    assert eager == ["eager_step"] * 3 + ["eager_average"] * 3  # every step before any sum
    assert a.called("eager_step") == [(2, 16, [], "")]
    assert c.called("eager_step") == [(2, 16, [], "")]
    # (the sum needs no count of samples: each share is weighed already)
    assert a.called("eager_average") == [(2, 0, ["fake:a", "fake:b"], "1/eager0")]
    await h.step()  # step 2 commits while stage 0's sum is held
    assert a.called("apply")[-1] == 2 and not held.opened.is_set()
    tasks = await h.lease()  # step 3: its commit ends round [2, 3], which waits for the sum
    for task in tasks:
        await h.run(task)
    await until(lambda: a.called("apply") and a.called("apply")[-1] == 3)
    await asyncio.sleep(0.2)
    assert len(a.called("eager_step")) == 1, "the next round's end waits for the last sum"
    held.open()
    await asyncio.wait_for(h.steps.get(), 10)
    assert [x[0] for x in a.called("eager_step")] == [2, 4]
    await h.step()
    await h.step()  # the last round: waited for, then the mean
    for r in (a, b, c):
        assert [x[0] for x in r.called("eager_last")] == [6]
        assert r.called("eager_last_apply") == [6]
        assert [x[0] for x in r.called("eager_mean")] == [6]
    order = [m for peer, m in swarm.log if peer == "a" and m.startswith("eager")]
    assert order[-3:] == ["eager_last", "eager_last_apply", "eager_mean"]
    syncs = [(r.step, r.stage, r.group, r.averaged, r.mean) for r in records if isinstance(r, Sync)]
    assert syncs == [
        (1, 0, ("a", "b"), None, None),
        (1, 1, ("c",), None, None),
        (3, 0, ("a", "b"), None, None),
        (3, 1, ("c",), None, None),
        (5, 0, ("a", "b"), None, None),
        (5, 1, ("c",), None, None),
    ]


async def test_eager_a_member_that_fails_the_background_sum_is_left_out_of_it(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    """b fails stage 0's sum of round [0, 1]: it is dropped, a sums again alone, b's samples
    of that round are counted as dropped, and the next round's record says whose shares the
    average holds."""
    job = _local(tmp_path, steps=4, overlap="eager")
    swarm, h, records, said = _pools(job, make_harness)
    a, b, c = swarm["a"], swarm["b"], swarm["c"]
    b.fail("eager_average", PeerUnavailable("b died"))
    await h.coordinator.start()
    await h.step({0: "b"})
    await h.step({0: "a"})
    await until(lambda: len(a.called("eager_average")) == 2)
    assert a.called("eager_average")[-1] == (2, 0, ["fake:a"], "1/eager1")
    assert c.called("eager_average") == [
        (2, 0, ["fake:c"], "1/eager0"),
        (2, 0, ["fake:c"], "1/eager1"),
    ]
    await until(lambda: h.coordinator.metrics.round_dropped._value.get() == 8)
    assert any("b failed the round's averaging, 8 samples dropped" in x for x in said)
    await h.step({0: "a"})
    await h.step({0: "a"})
    syncs = {(r.step, r.stage): r for r in records if isinstance(r, Sync)}
    assert syncs[(1, 0)].group == ("a", "b") and syncs[(1, 0)].averaged is None
    assert syncs[(3, 0)].group == ("a",) and syncs[(3, 0)].averaged == ("a",)
    assert syncs[(3, 1)].averaged is None


async def test_eager_a_coordinator_resuming_mid_job_sums_the_last_round_again(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    """Its predecessor may have died during the background sum of round [2, 3]'s shares: the
    members would wait for it forever at the next round's end. The new coordinator sums it
    again before that round's end."""
    job = _local(tmp_path, steps=8, overlap="eager")
    swarm = FakeSwarm(fingerprint(job), 2)  # type: ignore[arg-type]
    a, b, c = swarm.add(0, "a", step=5), swarm.add(0, "b", step=5), swarm.add(1, "c", step=5)
    h = make_harness(job, swarm)
    await h.coordinator.start()
    await until(lambda: len(c.called("eager_average")) == 1)
    assert a.called("eager_average") == [(4, 0, ["fake:a", "fake:b"], "3/eager0")]
    assert c.called("eager_average") == [(4, 0, ["fake:c"], "3/eager0")]
    await h.step()  # step 5 ends round [4, 5]: after the sum
    assert [x[0] for x in b.called("eager_step")] == [6]


async def test_eager_a_member_that_fails_its_outer_step_has_its_samples_counted(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    """b dies at round [0, 1]'s end before its outer step: it is dropped, its share reaches no
    average, and its samples of the round are counted as dropped (and said)."""
    job = _local(tmp_path, steps=4, overlap="eager")
    swarm, h, _records, said = _pools(job, make_harness)
    a, b = swarm["a"], swarm["b"]
    b.fail("eager_step", PeerUnavailable("b died"))
    await h.coordinator.start()
    await h.step({0: "b"})
    await h.step({0: "a"})
    await until(lambda: len(a.called("eager_average")) == 1)
    assert a.called("eager_average") == [(2, 0, ["fake:a"], "1/eager0")]
    assert h.coordinator.metrics.round_dropped._value.get() == 8
    assert any("b failed the round's outer step, 8 samples dropped" in x for x in said), said


def _resuming(
    tmp_path: Path, make_harness: MakeHarness, step: int, samples: dict[str, int]
) -> tuple[FakeSwarm, Harness, list[Record]]:
    """a and b of stage 0, c of stage 1, all at `step` with round [0, 1] unsynced and these
    samples in it, for a coordinator that starts there (its predecessor died)."""
    job = _local(tmp_path)
    swarm = FakeSwarm(fingerprint(job), 2)  # type: ignore[arg-type]
    for stage, peer in ((0, "a"), (0, "b"), (1, "c")):
        replica = swarm.add(stage, peer, step=step)
        replica.round_synced, replica.round_samples = 0, samples[peer]
    records: list[Record] = []
    h = make_harness(job, swarm, on_route=records.append)  # type: ignore[arg-type]
    return swarm, h, records


async def test_a_coordinator_resuming_mid_round_weighs_the_samples_taken_before_it(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    """Its predecessor committed step 0 (a took both microbatches at stage 0) and died: the
    round's end after step 1 weighs a's 8 samples too, which only the replicas still know."""
    swarm, h, _ = _resuming(tmp_path, make_harness, 1, {"a": 8, "b": 0, "c": 8})
    a, c = swarm["a"], swarm["c"]
    assert await h.coordinator.start() == 1
    await h.step({0: "b"})
    assert a.called("prepare_round") == [(2, 16, ["fake:a", "fake:b"], "1/round0")]
    assert c.called("prepare_round") == [(2, 16, ["fake:c"], "1/round0")]


async def test_a_coordinator_resuming_where_a_round_was_not_ended_ends_it_first(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    """Its predecessor applied step 1, the round's last, and died before the round's end: the
    replicas are at step 2 with the round [0, 1] unsynced. It is ended (with the replicas'
    counts) before step 2 opens, and the record says so."""
    swarm, h, records = _resuming(tmp_path, make_harness, 2, {"a": 12, "b": 4, "c": 16})
    a, c = swarm["a"], swarm["c"]
    assert await h.coordinator.start() == 2
    assert a.called("prepare_round") == [(2, 16, ["fake:a", "fake:b"], "1/round0")]
    assert c.called("apply_round") == [2]
    assert [(r.step, r.stage, r.group) for r in records if isinstance(r, Sync)] == [
        (1, 0, ("a", "b")),
        (1, 1, ("c",)),
    ]
    await h.step()  # and the job goes on


class _Lying(stage_pb2_grpc.StageServiceServicer):
    """A hostile peer's StageService: it answers Info as `replica` would, but for the last
    round's end it says it applied (`claimed`)."""

    def __init__(self, replica: FakeReplica, claimed: int) -> None:
        self.replica, self.claimed = replica, claimed

    async def Info(self, request: pb.StageInfoRequest, context: Any) -> pb.StageInfoResponse:
        reply = self.replica.honest_info()
        reply.round_synced = self.claimed
        return reply


@pytest.mark.parametrize("claimed", [-5, 10**12])
async def test_a_resuming_coordinator_counts_no_samples_a_replica_could_not_have_taken(
    tmp_path: Path, make_harness: MakeHarness, claimed: int
) -> None:
    """A replica's count is a peer's word: one outside what a round can hold (negative, or over
    its steps x the batch) is not believed; the replica counts nothing and the others stand."""
    swarm, h, _ = _resuming(tmp_path, make_harness, 1, {"a": claimed, "b": 8, "c": 8})
    assert await h.coordinator.start() == 1
    await h.step({0: "b"})
    assert swarm["b"].called("prepare_round") == [(2, 16, ["fake:a", "fake:b"], "1/round0")]


@pytest.mark.attack("N15")
@pytest.mark.parametrize("claimed", [10**12, 3, -7])
async def test_a_resuming_coordinator_ignores_a_round_end_no_replica_could_have_applied(
    tmp_path: Path, make_harness: MakeHarness, claimed: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 44, N15: the last round's end a replica says it applied is a peer's word too. The
    replicas are at step 2 with the round [0, 1] unended; b says it applied a round's end past
    the step the coordinator resumes at (or before any), in its Info answer sent by a real
    StageService over the wire. Before the fix the coordinator took the round for half
    applied and only applied it everywhere (no PREPARE: the pools never averaged it). Now b's
    word is refused with a warning and the round is ended as it must be."""
    swarm, h, _ = _resuming(tmp_path, make_harness, 2, {"a": 12, "b": 4, "c": 16})
    a, c = swarm["a"], swarm["c"]
    async with serving(_Lying(swarm["b"], claimed)) as address:
        swarm["b"].speaks_at = address  # b's Info answer: the lying server's bytes
        assert await h.coordinator.start() == 2
        # b's samples are not believed either: the group weighs a's 12.
        assert a.called("prepare_round") == [(2, 12, ["fake:a", "fake:b"], "1/round0")]
    assert c.called("prepare_round") == [(2, 16, ["fake:c"], "1/round0")]
    assert c.called("apply_round") == [2]
    assert f"says it applied the round's end at step {claimed}" in caplog.text


async def test_a_duplicate_reported_while_a_round_ends_leaves_the_replica_in_the_step(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    """The round that ends with a step ends within the step's commit attempt (the coordinator
    ends it once the attempt says the step applied): a straggler's duplicate reported meanwhile
    is held as it is during APPLY, not voided on a step that applied already."""
    job = _local(tmp_path)
    swarm, h, _, _ = _pools(job, make_harness)
    a, b, c = swarm["a"], swarm["b"], swarm["c"]
    await h.coordinator.start()
    await h.step({0: "a"})
    # Step 1 (it ends round 0): trainer A leases microbatch 0 and is slow; B takes both.
    assert await h.lease("A", 1) == [Task(1, 0, frozenset({0, 1}))]
    h.clock.advance(LEASE_S + 1)
    first, second = await h.lease("B", 2)
    ending = a.hold("prepare_round")
    await h.run(first, {0: "b"}, trainer="B")
    await h.run(second, {0: "a"}, trainer="B")  # complete: the step applies, the round ends
    await asyncio.wait_for(ending.entered.wait(), 10)
    assert (a.step, b.step, c.step) == (2, 2, 2)  # applied: the round's end is under way
    await h.run(first, {0: "a"}, trainer="A")  # a duplicate of b's microbatch 0 on a
    assert not a.called("discard")
    ending.open()
    assert (await asyncio.wait_for(h.steps.get(), 10)).step == 1
    assert not a.called("discard")
    assert [[r.peer for r in s] for s in h.coordinator.replicas()] == [["a", "b"], ["c"]]
    assert {(t.step, t.index) for t in await h.lease("B", 2)} == {(2, 0), (2, 1)}


async def test_a_record_through_a_coordinators_restart_replays(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    """A scheduler restarted after a round: its coordinator resumes the pools as they were. It
    wrote a `Join` from the initial parameters for every member, and `swarm local --routes`
    refused the record ("joins stage 0, which it already serves")."""
    job = _local(tmp_path)
    _, first, records, _ = _pools(job, make_harness)
    await first.coordinator.start()
    await first.step({0: "a"})
    await first.step({0: "b"})  # the round after step 1 ends
    await first.coordinator.close()  # the scheduler stops
    swarm = FakeSwarm(fingerprint(job), 2)  # type: ignore[arg-type]
    for stage, peer in ((0, "a"), (0, "b"), (1, "c")):
        replica = swarm.add(stage, peer, step=2)
        replica.round_synced, replica.round_samples = 2, 0  # the round ended and applied
    again = make_harness(job, swarm, on_route=records.append)  # type: ignore[arg-type]
    assert await again.coordinator.start() == 2
    await again.step({0: "a"})
    await again.step({0: "a"})
    resumed = [r for r in records if isinstance(r, Resume)]
    assert [(r.step, r.stage, r.peers) for r in resumed] == [(2, 0, ("a", "b")), (2, 1, ("c",))]
    train_replicas(job, routes=records)  # type: ignore[arg-type]
