"""A round's group at the coordinator (`scheduler.coordinator.groups`): parts sized once per round
from the links the members announced and sent with every PREPARE (steps, local rounds, eager
rounds), relayed members and slow links in client mode, aggregators after the replicas, and an
aggregator named in an aborted round left out of the retry."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from scheduler.coordinator.groups import Aggregator, Groups, Link, RoundGroup, link_of
from swarm.clock import FakeClock
from swarm.errors import Aborted
from swarm.job.fingerprint import fingerprint
from swarm.proto import control_pb2 as cpb
from swarm.rpc.lease import Replica
from tests.support.coordinator import LEASE_S, MakeHarness, job_of
from tests.support.jobs import make_job
from tests.support.replicas import FakeSwarm

pytestmark = pytest.mark.timeout(60)

MBIT = 1e6 / 8


def _replicas(*peers: str) -> list[Replica]:
    return [Replica(p, f"fake:{p}") for p in peers]


def test_a_peers_link_is_its_upload_rate_and_whether_it_is_relayed() -> None:
    a = cpb.PeerAnnouncement(peer="a", upload_bytes_per_second=10.0)
    a.download_bytes_per_second = 30.0
    assert link_of(a) == Link(10.0, False)
    # A download measured in a round is held down by its slowest sender (41-52 of 100 Mbit/s in
    # bench/uneven.py's pool with one 10 Mbit/s uplink): it would make a fast peer look slow.
    fast = cpb.PeerAnnouncement(peer="f", upload_bytes_per_second=100.0)
    fast.download_bytes_per_second = 45.0
    assert link_of(fast) == Link(100.0, False)
    assert link_of(cpb.PeerAnnouncement(peer="b", download_bytes_per_second=7.0)) == Link(7.0)
    assert link_of(cpb.PeerAnnouncement(peer="c", relay="r:1")) == Link(0.0, True)
    assert link_of(None) == Link()


def test_unknown_or_equal_links_keep_todays_equal_parts() -> None:
    made = Groups().of(0, _replicas("a", "b", "c"))
    assert made == RoundGroup(("fake:a", "fake:b", "fake:c"), peers=("a", "b", "c"))
    same = Groups(lambda peer: Link(5.0))
    assert same.of(0, _replicas("a", "b", "c")).parts.weights == ()
    alone = Groups(lambda peer: Link(5.0)).of(0, _replicas("a"))
    assert alone == RoundGroup(("fake:a",), peers=("a",))


def test_a_slow_or_relayed_member_owns_nothing() -> None:
    links = {"a": Link(10 * MBIT)} | {p: Link(100 * MBIT) for p in "bcd"}
    group = Groups(links.__getitem__).of(0, _replicas("a", "b", "c", "d"))
    assert group.parts.weights[0] == 0 and group.parts.weights[1:] == pytest.approx([1 / 3] * 3)
    assert group.parts.contributors == 0  # no aggregators: every member contributes
    links["a"] = Link(100 * MBIT)
    links["c"] = Link(100 * MBIT, relayed=True)
    group = Groups(links.__getitem__).of(0, _replicas("a", "b", "c", "d"))
    assert group.parts.weights[2] == 0 and group.parts.weights[0] == pytest.approx(1 / 3)


def test_aggregators_come_after_the_replicas_and_a_named_one_sits_out() -> None:
    clock = FakeClock()
    offered = [Aggregator("g", "agg:1", Link(200.0)), Aggregator("h", "fake:a", Link(1.0))]
    groups = Groups(lambda peer: Link(100.0), lambda stage: offered, clock=clock, shun_s=30)
    group = groups.of(0, _replicas("a", "b", "c"))
    # One that is a replica's own address is not a second member of the group.
    assert group.members == ("fake:a", "fake:b", "fake:c", "agg:1")
    assert group.peers == ("a", "b", "c", "g")  # each member's peer id, as its ticket names
    assert group.parts.contributors == 3 and group.parts.weights[3] > group.parts.weights[0] > 0
    assert groups.blame({0: group}, {0: {0: {3}, 1: {1}}}) == ["g"]  # 1 names itself: no one
    assert groups.of(0, _replicas("a", "b", "c")).members == ("fake:a", "fake:b", "fake:c")
    clock.advance(31)
    assert groups.of(0, _replicas("a", "b", "c")).members[-1] == "agg:1"


async def test_a_steps_prepare_carries_the_parts_and_the_aggregators(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    job = job_of(tmp_path, target_batch_size=12)  # three microbatches
    swarm = FakeSwarm(fingerprint(job), 2)
    a, b, x = swarm.add(0, "a"), swarm.add(0, "b"), swarm.add(0, "x")
    c = swarm.add(1, "c")
    rates = {"a": 100 * MBIT, "b": 100 * MBIT, "x": 10 * MBIT, "c": 50 * MBIT}
    aggregators = {0: [Aggregator("g", "agg:0", Link(100 * MBIT))]}
    groups = Groups(
        lambda peer: Link(rates[peer]), lambda stage: aggregators.get(stage, []), clock=FakeClock()
    )
    h = make_harness(job, swarm, groups=groups)
    await h.coordinator.start()
    # The aggregator fails the first round (every replica names it): the retry goes without it.
    a.fail("prepare", Aborted("round aborted: agg:0 unreachable", [3]))
    tasks = await h.lease()
    for task, peer in zip(tasks, "abx", strict=True):
        await h.run(task, {0: peer})
    assert (await asyncio.wait_for(h.steps.get(), 10)).step == 0
    first, last = a.called("prepare")[0], a.called("prepare")[-1]
    assert first.group == ["fake:a", "fake:b", "fake:x", "agg:0"] and first.contributors == 3
    assert first.weights[2] == 0  # x: a client
    assert last.group == ["fake:a", "fake:b", "fake:x"] and last.contributors == 0
    assert last.weights == pytest.approx((0.5, 0.5, 0.0))
    assert x.called("prepare")[-1].weights == last.weights  # every member the same parts
    assert c.called("prepare")[-1].weights == ()  # alone
    assert b.called("discard") == [] and x.called("discard") == []  # no replica blamed


@pytest.mark.parametrize("overlap", ["none", "eager"])
async def test_rounds_carry_the_same_parts(
    tmp_path: Path, make_harness: MakeHarness, overlap: str
) -> None:
    training = {
        "stages": 2,
        "microbatch_size": 4,
        "target_batch_size": 8,
        "steps": 2,
        "checkpoint_every": 0,
    }
    runtime = {"lease_timeout_s": LEASE_S, "data_plane": "relay"}
    pool = {"mode": "local", "sync_every": 2, "overlap": overlap}
    job = make_job(tmp_path, training=training, runtime=runtime, pool=pool)
    swarm = FakeSwarm(fingerprint(job), 2)
    a, b, x = swarm.add(0, "a"), swarm.add(0, "b"), swarm.add(0, "x")
    swarm.add(1, "c")
    rates = {"a": 100.0, "b": 80.0, "x": 5.0, "c": 1.0}
    h = make_harness(job, swarm, groups=Groups(lambda peer: Link(rates[peer])))
    await h.coordinator.start()
    for _ in range(2):
        await h.step({0: "a"})
    await asyncio.wait_for(h.coordinator.finished.wait(), 20)
    averaging = [p for p in a.parts if p[0] != "prepare" and p[0] != "eager_step"]
    assert averaging, a.parts
    expected = Groups(lambda peer: Link(rates[peer])).of(0, _replicas("a", "b", "x")).parts.weights
    assert expected[2] == 0 and len(expected) == 3
    for member in (a, b, x):
        rounds = [p for p in member.parts if p[0] != "prepare" and p[0] != "eager_step"]
        assert [w for _, w, _ in rounds] == [expected] * len(rounds)
    # A local step averages with no one: no parts.
    assert all(w == () for name, w, _ in a.parts if name == "prepare")
