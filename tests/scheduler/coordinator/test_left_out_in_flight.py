"""A replica the peer registry leaves out (hung: its load reports stopped) while the coordinator
waits on a PREPARE it sent it: the coordinator stops waiting at once and goes on with the
others, as it would had the replica been left out before the call, and says why. Before, the
call waited its whole deadline (`runtime.commit_timeout_s`, 2 minutes by default) and so did
the step. Each job here has an hour's deadline: a step that commits did not wait for it."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from scheduler.coordinator.listed import while_listed
from swarm.deadline import within
from swarm.errors import Aborted, PeerUnavailable
from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.rpc.lease import Replica, Task
from tests.support.coordinator import LEASE_S, MakeHarness
from tests.support.jobs import make_job
from tests.support.replicas import FakeReplica, FakeSwarm

pytestmark = pytest.mark.timeout(60)

HOUR_S = 3600.0  # the calls' deadline: never reached while the test runs


def _job(tmp_path: Path, **pool: object) -> JobConfig:
    training = {"stages": 2, "microbatch_size": 4, "target_batch_size": 8, "steps": 4}
    runtime = {"lease_timeout_s": LEASE_S, "commit_timeout_s": HOUR_S}
    return make_job(tmp_path, training=training, runtime=runtime, pool=pool)


def _partner(a: FakeReplica, b: FakeReplica, how: str) -> None:
    """How a's averaging takes b's silence: it `answers` (b's part is not needed: a fake's
    round), `aborts` naming b (it cannot reach b), or `waits` for b's parts until the round's
    averaging timeout (an hour here), as a real replica's does for a member that hangs, or
    moved to another stage mid-PREPARE, and never sends them. Waiting, a's call is called off
    with b's: its round cannot end; before, the step waited out a's averaging timeout (the
    rebalancing test's 60 s)."""
    if how == "aborts":
        a.cannot_reach(b)
    elif how == "waits":
        a.waits_on(b)


@pytest.mark.parametrize("how", ["aborts", "waits"])
async def test_a_prepare_in_flight_to_a_replica_the_registry_leaves_out_is_not_waited_for(
    tmp_path: Path, make_harness: MakeHarness, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    job = _job(tmp_path)
    swarm = FakeSwarm(fingerprint(job), 2)
    a, b, c = swarm.add(0, "a"), swarm.add(0, "b"), swarm.add(1, "c")
    hung = b.hold("prepare")  # b stops (SIGSTOP) with the PREPARE on its way: it never answers
    _partner(a, b, how)
    h = make_harness(job, swarm)
    await h.coordinator.start()
    first, second = await h.lease()
    await h.run(first, {0: "a"})
    await h.run(second, {0: "b"})
    await within(hung.entered.wait(), 10)
    with caplog.at_level(logging.WARNING, logger="scheduler.coordinator"):
        swarm.remove("b")  # its load reports stopped: the registry lists it no more
        # b's microbatch is replayed on a, at b's stage only, and the step commits without b
        replay = await h.lease()
        assert replay == [Task(0, 1, frozenset({0}))]
        await h.run(replay[0], {0: "a"})
        assert (await within(h.steps.get(), 10)).step == 0
    assert not hung.opened.is_set() and b.called("apply") == []  # b never answered
    assert (a.step, c.step) == (1, 1)
    groups = [p.group for p in a.called("prepare")]
    assert groups == [[a.address, b.address], [a.address]], groups
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("b" in s and "left out by the peer registry" in s for s in said), said


@pytest.mark.parametrize("how", ["answers", "waits"])
async def test_a_round_prepare_in_flight_to_a_replica_the_registry_leaves_out_is_not_waited_for(
    tmp_path: Path, make_harness: MakeHarness, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    # pool.mode = "local": the round after step 1 averages a and b; b hangs in it.
    job = _job(tmp_path, mode="local", sync_every=2)
    swarm = FakeSwarm(fingerprint(job), 2)
    a, b, c = swarm.add(0, "a"), swarm.add(0, "b"), swarm.add(1, "c")
    h = make_harness(job, swarm)
    await h.coordinator.start()
    await h.step({0: "a"})
    hung = b.hold("prepare_round")
    _partner(a, b, how)
    stepped = asyncio.ensure_future(h.step({0: "a"}))  # step 1, and the round that ends with it
    await within(hung.entered.wait(), 10)
    with caplog.at_level(logging.WARNING, logger="scheduler.coordinator"):
        swarm.remove("b")
        assert (await within(stepped, 10)).step == 1
    assert not hung.opened.is_set() and b.called("apply_round") == []
    assert a.called("apply_round") == [2] and c.called("apply_round") == [2]
    if how == "waits":  # called off, and again without b (one that answered needs no retry)
        groups = [args[2] for args in a.called("prepare_round")]
        assert groups == [[a.address, b.address], [a.address]], groups
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("b" in s and "left out by the peer registry" in s for s in said), said


async def test_a_call_left_out_calls_off_the_others_of_its_round_alone() -> None:
    # b is left out: a, in b's round, cannot end it and is called off, its outcome Aborted
    # naming b's place in the round; c (another stage's round) and d (a round of its own at
    # b's stage: a local step) are waited for and answer.
    a, b, c, d = (Replica(p, f"fake:{p}") for p in "abcd")
    released = asyncio.Event()

    async def hangs() -> str:
        await asyncio.Event().wait()
        return "never"

    async def answers() -> str:
        await released.wait()
        return "answered"

    looks = 0

    def listed() -> list[list[Replica]]:
        nonlocal looks
        looks += 1
        if looks > 1:
            released.set()  # after b was left out
        return [[a, d], [c]]

    calls = [(0, a, hangs()), (0, b, hangs()), (1, c, answers()), (0, d, answers())]
    pools = [[a.address, b.address], [a.address, b.address], [c.address], [d.address]]
    outcomes = await within(while_listed(listed, calls, "PREPARE", 0.01, pools=pools), 10)
    assert isinstance(outcomes[1], PeerUnavailable)
    assert isinstance(outcomes[0], Aborted) and outcomes[0].missing == (1,), outcomes[0]
    assert "b" in str(outcomes[0]) and "left out" in str(outcomes[0])
    assert outcomes[2:] == ["answered", "answered"]


async def test_members_of_one_round_left_out_together_or_in_turn_are_each_gone() -> None:
    # A home outage takes a round's members at one look: each is gone (dropped, replayed), none
    # called off as the other's partner, which would keep it a member though unlisted. One
    # called off, then left out itself at a later look, is gone too.
    a, b, c = (Replica(p, f"fake:{p}") for p in "abc")
    looks: list[list[list[Replica]]] = [[[]]]

    async def hangs() -> str:
        await asyncio.Event().wait()
        return "never"

    pool = [a.address, b.address]
    calls = [(0, a, hangs()), (0, b, hangs())]
    together = await within(
        while_listed(lambda: looks[0], calls, "PREPARE", 0.01, pools=[pool, pool]), 10
    )
    assert [type(o) for o in together] == [PeerUnavailable, PeerUnavailable], together
    # Another stage's call (d's) still in flight keeps the looks going.
    d, released = Replica("d", "fake:d"), asyncio.Event()
    pool = [a.address, b.address, c.address]
    seen = 0

    async def answers() -> str:
        await released.wait()
        return "answered"

    def in_turn() -> list[list[Replica]]:
        nonlocal seen
        seen += 1
        if seen > 2:
            released.set()
        return [[b, c], [d]] if seen == 1 else [[c], [d]]  # a first; b, called off, next

    calls = [(0, a, hangs()), (0, b, hangs()), (0, c, hangs()), (1, d, answers())]
    pools = [pool, pool, pool, [d.address]]
    outcomes = await within(while_listed(in_turn, calls, "PREPARE", 0.01, pools=pools), 10)
    kinds = [type(o) for o in outcomes[:3]]
    assert kinds == [PeerUnavailable, PeerUnavailable, Aborted], outcomes
    assert outcomes[3] == "answered"


async def test_calls_while_listed_answer_as_gather_and_end_with_their_caller() -> None:
    # Listed replicas' calls are waited for whatever they take; their outcomes (answers and
    # errors) come back in order. A caller cancelled cancels every call still in flight.
    a, b = Replica("a", "fake:a"), Replica("b", "fake:b")
    released, held = asyncio.Event(), asyncio.Event()

    async def answers() -> str:
        await released.wait()
        return "answered"

    async def fails() -> str:
        raise PeerUnavailable("refused")

    async def hangs() -> str:
        try:
            await asyncio.Event().wait()
        finally:
            held.set()  # it ended: cancelled with its caller
        return "never"

    def listed() -> list[list[Replica]]:
        released.set()  # the first look at the registry lets `answers` answer
        return [[a, b]]

    answered = await while_listed(listed, [(0, a, answers()), (0, b, fails())], "PREPARE", 0.01)
    assert answered[0] == "answered" and isinstance(answered[1], PeerUnavailable)
    caller = asyncio.ensure_future(while_listed(listed, [(0, a, hangs())], "PREPARE", 0.01))
    await asyncio.sleep(0.05)
    caller.cancel()
    await within(held.wait(), 10)
    assert caller.cancelled()
