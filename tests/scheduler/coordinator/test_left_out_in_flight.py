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
from swarm.errors import PeerUnavailable
from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.rpc.lease import Replica, Task
from tests.support.coordinator import LEASE_S, MakeHarness
from tests.support.jobs import make_job
from tests.support.replicas import FakeSwarm

pytestmark = pytest.mark.timeout(60)

HOUR_S = 3600.0  # the calls' deadline: never reached while the test runs


def _job(tmp_path: Path, **pool: object) -> JobConfig:
    training = {"stages": 2, "microbatch_size": 4, "target_batch_size": 8, "steps": 4}
    runtime = {"lease_timeout_s": LEASE_S, "commit_timeout_s": HOUR_S}
    return make_job(tmp_path, training=training, runtime=runtime, pool=pool)


async def test_a_prepare_in_flight_to_a_replica_the_registry_leaves_out_is_not_waited_for(
    tmp_path: Path, make_harness: MakeHarness, caplog: pytest.LogCaptureFixture
) -> None:
    job = _job(tmp_path)
    swarm = FakeSwarm(fingerprint(job), 2)
    a, b, c = swarm.add(0, "a"), swarm.add(0, "b"), swarm.add(1, "c")
    hung = b.hold("prepare")  # b stops (SIGSTOP) with the PREPARE on its way: it never answers
    a.cannot_reach(b)  # a's round aborts, naming b, as a real replica's would
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
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("b" in s and "left out by the peer registry" in s for s in said), said


async def test_a_round_prepare_in_flight_to_a_replica_the_registry_leaves_out_is_not_waited_for(
    tmp_path: Path, make_harness: MakeHarness, caplog: pytest.LogCaptureFixture
) -> None:
    # pool.mode = "local": the round after step 1 averages a and b; b hangs in it.
    job = _job(tmp_path, mode="local", sync_every=2)
    swarm = FakeSwarm(fingerprint(job), 2)
    a, b, c = swarm.add(0, "a"), swarm.add(0, "b"), swarm.add(1, "c")
    h = make_harness(job, swarm)
    await h.coordinator.start()
    await h.step({0: "a"})
    hung = b.hold("prepare_round")
    stepped = asyncio.ensure_future(h.step({0: "a"}))  # step 1, and the round that ends with it
    await within(hung.entered.wait(), 10)
    with caplog.at_level(logging.WARNING, logger="scheduler.coordinator"):
        swarm.remove("b")
        assert (await within(stepped, 10)).step == 1
    assert not hung.opened.is_set() and b.called("apply_round") == []
    assert a.called("apply_round") == [2] and c.called("apply_round") == [2]
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("b" in s and "left out by the peer registry" in s for s in said), said


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
