"""`client.outage` alone, on a hand-moved clock: since when the scheduler is silent, the pauses
between asks, the bound, and what the views say."""

from __future__ import annotations

import asyncio
import math
import time

import grpc

from client.outage import Outage
from client.sdk import SchedulerClient
from swarm.clock import FakeClock
from swarm.policy.backoff import Backoff
from swarm.proto import control_pb2 as cpb
from swarm.proto import scheduler_pb2, scheduler_pb2_grpc


def test_an_outage_is_timed_from_its_first_unanswered_ask_and_ends_when_one_is_answered() -> None:
    clock = FakeClock(1_000_000.0)
    outage = Outage(60.0, clock=clock.now, backoff=Backoff(first_s=1.0, cap_s=4.0, jitter=0.0))
    assert outage.answered() is None  # no outage yet
    assert [outage.failed() for _ in range(4)] == [1.0, 2.0, 4.0, 4.0]  # capped
    since = time.strftime("%H:%M:%S", time.localtime(clock.t))
    clock.advance(15)
    assert outage.text() == f"scheduler unreachable since {since} (15 s): retrying"
    assert outage.answered() == 15.0
    assert outage.failed() == 1.0  # a new outage starts its pauses afresh


def test_it_gives_up_after_its_bound_and_a_watch_never_does() -> None:
    clock = FakeClock(1_000_000.0)
    outage = Outage(60.0, clock=clock.now)
    assert outage.failed() is not None
    clock.advance(59)
    assert outage.failed() is not None
    clock.advance(1)
    assert outage.failed() is None
    assert outage.gave_up() == "no answer for 1m00s (--retry-for): giving up"
    forever = Outage(math.inf, clock=clock.now)
    forever.failed()
    clock.advance(10**7)
    assert forever.failed() is not None


class _Hangs(scheduler_pb2_grpc.SchedulerServiceServicer):
    """A real scheduler's API that answers the first GetJob, then none until `release` is set,
    as a call across a pulled router hangs until its deadline."""

    def __init__(self) -> None:
        self.asks, self.release, self.answered = 0, asyncio.Event(), False

    async def GetJob(
        self, request: scheduler_pb2.SchedulerGetJobRequest, context: object
    ) -> scheduler_pb2.SchedulerGetJobResponse:
        self.asks += 1
        if self.asks > 1:
            await self.release.wait()
        self.answered = True
        job = scheduler_pb2.JobStatus(job=request.job, state=cpb.JOB_STATE_RUNNING)
        return scheduler_pb2.SchedulerGetJobResponse(job=job)


async def test_a_view_says_the_scheduler_is_silent_while_an_ask_hangs_since_its_last_answer() -> (
    None
):
    """Issue 68 item 5: the watch said nothing until the ask's 30 s deadline ran out, then
    stamped the outage `(0 s)`. Now it says so while the ask still hangs, timed from the last
    answer; and the late answer is still taken."""
    servicer = _Hangs()
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    clock = FakeClock(1_000_000.0)
    outage = Outage(math.inf, clock=clock.now)
    said: list[tuple[str, bool]] = []

    def unreachable(o: Outage) -> None:
        said.append((o.text(), servicer.answered))
        servicer.release.set()

    try:
        async with SchedulerClient(address, timeout_s=60.0) as client:
            await client.get_through("j-1", outage, unreachable)  # answered at 1_000_000
            last = time.strftime("%H:%M:%S", time.localtime(clock.t))
            clock.advance(31)  # the router is pulled; the next ask hangs
            servicer.answered = False
            status = await client.get_through("j-1", outage, unreachable, notice_s=0.05)
    finally:
        await server.stop(None)
    assert said[0] == (f"scheduler unreachable since {last} (31 s): retrying", False)
    assert status.job == "j-1" and outage.since is None  # the late answer ended it
