"""The aggregator peer (issue 43, item 4): a real `swarm aggregator` process on a real broker.

It announces itself (role AGGREGATOR, its PoolService address, its link rates) and goes offline
in order; it takes `Reduce` calls only for a stage of a job announced running, with the token,
and within `--max-memory-bytes`, refusing every other call by name. With helper "parts"'s owner
side (an owner sums the `contributors` senders, aggregators contribute nothing) it owns a part of
a real pool's round: float64 equal to the plain sum, its SIGKILL mid-round a member's failure
(the round aborted naming it, retried without it, nothing lost), and a hostile one changes only
the part it owns. Those tests skip, naming what they need, until "parts" is merged."""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from scheduler.dial_back import StageDialer
from stage_server.aggregator.main import PoolJobs
from stage_server.averaging.butterfly import RoundSettings, all_reduce
from stage_server.averaging.owner import AveragingAborted
from stage_server.averaging.summing import Reduced
from swarm.bus.broker import EmbeddedBroker
from swarm.bus.connection import Bus, Subscription
from swarm.bus.topics import SCHEDULER_USER, Topics
from swarm.errors import NotFound
from swarm.local.procs import SwarmProcess, start_process
from swarm.net import dial
from swarm.net.round_tickets import RoundPass, issue_round_ticket
from swarm.policy import parts
from swarm.policy.parts import Parts
from swarm.proto import control_pb2 as cpb
from swarm.proto import pool_pb2, pool_pb2_grpc
from swarm.wire import chunking as wire
from tests.support.jobs import BASE, render
from tests.support.pools import JOB, OPTIONS, MiB, Replica, reduce_all, replicas

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

TOKEN, SCHEDULER_TOKEN = "swarm-token", "scheduler-token"
WAIT_S = 60.0
# Its rounds time out in 3 s, the deadline `reduce`'s member calls with, as an honest member's
# call lasts its round's timeout: such a wait, ended, aborts the round naming whom it waited for
# (one far shorter than the round's is the caller's own: `Averager.reduce`).
SPEC = render(
    {
        **BASE,
        "training": {**BASE["training"], "stages": 2},
        "runtime": {**BASE.get("runtime", {}), "averaging_timeout_s": 3.0},
    }
)


@pytest.fixture
async def broker() -> AsyncIterator[EmbeddedBroker]:
    async with EmbeddedBroker(token=TOKEN, scheduler_token=SCHEDULER_TOKEN) as b:
        yield b


@pytest.fixture
async def open_broker() -> AsyncIterator[EmbeddedBroker]:
    """For rounds with `tests.support.pools`'s replicas, which dial without a token."""
    async with EmbeddedBroker() as b:
        yield b


@contextlib.asynccontextmanager
async def scheduler_bus(broker: EmbeddedBroker) -> AsyncIterator[Bus]:
    """What the scheduler publishes (job announcements) and sees (peer announcements)."""
    token = SCHEDULER_TOKEN if broker.token else None
    bus = Bus(
        broker.url, "scheduler", username=SCHEDULER_USER, token=token, registry=CollectorRegistry()
    )
    async with bus:
        await bus.wait_connected(WAIT_S)
        yield bus


@contextlib.asynccontextmanager
async def aggregator(
    broker: EmbeddedBroker, tmp_path: Path, *flags: str, token: str | None = TOKEN
) -> AsyncIterator[SwarmProcess]:
    """`swarm aggregator --broker URL --peer agg --metrics-port 0 FLAGS`, ready (waited for on
    a thread: the broker runs on this event loop)."""
    env = {"SWARM_CACHE_DIR": str(tmp_path / "cache"), "SWARM_TOKEN": token or ""}
    args = ["aggregator", "--broker", broker.url, "--peer", "agg", "--metrics-port", "0", *flags]
    proc = start_process(args, log_dir=tmp_path, name="aggregator", env=env)
    try:
        await asyncio.to_thread(proc.wait_ready, WAIT_S)
        yield proc
    finally:
        proc.kill()


async def announcement(sub: Subscription, state: int) -> cpb.PeerAnnouncement:
    async with asyncio.timeout(WAIT_S):
        async for _, message in sub:
            if isinstance(message, cpb.PeerAnnouncement) and message.state == state:
                return message
    raise AssertionError("the subscription ended")


async def announce_job(bus: Bus, state: int, job: str = "j-1") -> None:
    message = cpb.JobAnnouncement(job=job, spec=SPEC, state=state)  # type: ignore[arg-type]
    await bus.publish(bus.topics.job(job), message, retain=True)


def metrics(proc: SwarmProcess, token: str | None = TOKEN) -> dict[str, list[Any]]:
    """Its /metrics: each family's samples."""
    request = urllib.request.Request(f"http://127.0.0.1:{proc.ready['metrics']}/metrics")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    return {f.name: list(f.samples) for f in text_string_to_metric_families(text)}


def held(proc: SwarmProcess, token: str | None = TOKEN) -> float:
    return float(metrics(proc, token)["swarm_aggregator_memory_bytes"][0].value)


async def reduce(
    address: str,
    *,
    job: str = "j-1",
    stage: int = 0,
    round: str = "r",
    values: torch.Tensor | None = None,
    timeout_s: float = 3.0,
    token: str | None = TOKEN,
    ticket: Ed25519PrivateKey | None = None,
) -> tuple[grpc.StatusCode, str]:
    """One member's contribution to part 1 of a round of 2 (as sender 0): how it ended.
    `ticket`: with the round ticket that scheduler key signs (`swarm.net.round_tickets`)."""
    values = torch.ones(4, dtype=torch.float64) if values is None else values
    header = pool_pb2.PoolReduceRequest(
        job=job, stage=stage, round=round, part=1, sender=0, group_size=2
    )
    if ticket is not None:
        peers = ("member-0", "agg")  # part 1 is the aggregator's (`--peer agg`)
        place = {"job": job, "stage": stage, "round": round, "sender": 0, "peers": peers}
        made = issue_round_ticket(ticket, **place, contributors=0, now=time.time())
        header.proof.CopyFrom(RoundPass(made, peers).to(1))
    async with dial.channel(address, token=token, options=OPTIONS) as channel:
        call: Any = pool_pb2_grpc.PoolServiceStub(channel).Reduce(timeout=timeout_s)
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            for message in wire.split_tensor(header, "part", values, 4 * MiB):
                await call.write(message)
            await call.done_writing()
            async for _ in call:
                pass
        return await call.code(), await call.details()


async def until_taken(address: str, **kwargs: Any) -> tuple[grpc.StatusCode, str]:
    """`reduce` until the aggregator has read the job's announcement (it arrives by the broker,
    a moment after it was published): a refusal of the job as unknown is retried."""
    for attempt in range(200):
        code, details = await reduce(address, round=f"r-{attempt}", **kwargs)
        if code != grpc.StatusCode.NOT_FOUND:
            return code, details
        await asyncio.sleep(0.1)
    raise AssertionError(f"the aggregator never took the job: {details}")


async def test_an_aggregator_announces_its_role_address_and_rates_and_stops_in_order(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    async with scheduler_bus(broker) as bus:
        peers = bus.subscribe(Topics().peer("agg"))
        await peers.wait_subscribed(WAIT_S)
        async with aggregator(broker, tmp_path, "--bandwidth", "1gbit/200M") as proc:
            said = await announcement(peers, cpb.PEER_STATE_SERVING)
            assert said.role == cpb.PEER_ROLE_AGGREGATOR
            assert said.address == proc.address and not said.HasField("stage") and not said.job
            assert (said.upload_bytes_per_second, said.download_bytes_per_second) == (125e6, 25e6)
            assert said.metrics_address.endswith(f":{proc.ready['metrics']}")
            # The scheduler's dial-back finds it as itself (issue 54: not by an UNIMPLEMENTED)
            assert await StageDialer(TOKEN).answer(proc.address, WAIT_S) == "agg"
            shown = metrics(proc)
            (info,) = shown["swarm_peer_info"]
            assert info.labels == {"peer": "agg", "state": "aggregating", "job": "", "stage": ""}
            assert shown["swarm_aggregator_memory_limit_bytes"][0].value == 1 << 30  # the default
            assert await asyncio.to_thread(proc.stop) == 0  # SIGTERM: in order
            gone = await announcement(peers, cpb.PEER_STATE_OFFLINE)
            assert gone.time > 0  # said by it, not its will
            assert "announced offline" in proc.log()


async def test_its_will_says_it_is_gone_when_killed(broker: EmbeddedBroker, tmp_path: Path) -> None:
    async with scheduler_bus(broker) as bus:
        peers = bus.subscribe(Topics().peer("agg"))
        await peers.wait_subscribed(WAIT_S)
        async with aggregator(broker, tmp_path) as proc:
            await announcement(peers, cpb.PEER_STATE_SERVING)
            proc.kill()
            will = await announcement(peers, cpb.PEER_STATE_OFFLINE)
            assert will.role == cpb.PEER_ROLE_AGGREGATOR and will.address == proc.address
            assert will.time == 0  # its will: the broker's, with no time


@pytest.mark.attack("43.4")
async def test_it_takes_parts_of_running_jobs_only_and_refuses_every_other_call(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    async with scheduler_bus(broker) as bus, aggregator(broker, tmp_path) as proc:
        address = proc.address
        code, details = await reduce(address)
        assert code == grpc.StatusCode.NOT_FOUND
        assert "job 'j-1' is unknown here" in details and "running jobs only: none" in details
        await announce_job(bus, cpb.JOB_STATE_RUNNING)
        # Taken: it waits for sender 1, which never comes, and says so by the deadline.
        code, details = await until_taken(address)
        assert code == grpc.StatusCode.ABORTED and "waiting for senders [1]" in details
        code, details = await reduce(address, stage=2)
        assert code == grpc.StatusCode.NOT_FOUND and "has stages 0..1, not 2" in details
        code, details = await reduce(address, job="j-2")
        assert code == grpc.StatusCode.NOT_FOUND and "running jobs only: ['j-1']" in details
        code, _ = await reduce(address, token="wrong")
        assert code == grpc.StatusCode.UNAUTHENTICATED
        async with dial.channel(address, token=TOKEN) as channel:  # no stage served here
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await channel.unary_unary("/swarm.proto.StageService/Forward")(b"")
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
        await announce_job(bus, cpb.JOB_STATE_CANCELLED)
        for attempt in range(200):
            code, details = await reduce(address, round=f"after-{attempt}")
            if code == grpc.StatusCode.NOT_FOUND:
                break
            await asyncio.sleep(0.1)
        assert code == grpc.StatusCode.NOT_FOUND and "job j-1 is cancelled" in details


async def test_each_jobs_rounds_time_out_at_that_jobs_own_timeout(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    # An aggregator serving two jobs bounded every round by the larger of their averaging
    # timeouts: a member of the 3 s job, its call of 3 s ended, found its part open for less
    # than half of 600 s, and was answered naming nobody (its own deadline), so the members
    # blamed the honest aggregator for the sender that never came. Each job's rounds keep
    # that job's timeout.
    async with scheduler_bus(broker) as bus, aggregator(broker, tmp_path) as proc:
        await announce_job(bus, cpb.JOB_STATE_RUNNING)  # 3 s a round (SPEC)
        slow = render(
            {
                **BASE,
                "training": {**BASE["training"], "stages": 2},
                "runtime": {**BASE.get("runtime", {}), "averaging_timeout_s": 600.0},
            }
        )
        message = cpb.JobAnnouncement(job="j-2", spec=slow, state=cpb.JOB_STATE_RUNNING)
        await bus.publish(bus.topics.job("j-2"), message, retain=True)
        await until_taken(proc.address, job="j-2", timeout_s=0.5)  # both known
        code, details = await reduce(proc.address, round="each")
        assert code == grpc.StatusCode.ABORTED and "waiting for senders [1]" in details, details


@pytest.mark.attack("round-members")
async def test_a_job_announced_with_its_schedulers_key_takes_its_members_parts_only(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    # An aggregator gets no PREPARE: the scheduler's key comes with the job's announcement, and
    # a contribution without the round ticket it signed is refused before a byte is held.
    key = Ed25519PrivateKey.generate()
    async with scheduler_bus(broker) as bus, aggregator(broker, tmp_path) as proc:
        public = key.public_key().public_bytes_raw()
        message = cpb.JobAnnouncement(
            job="j-1", spec=SPEC, state=cpb.JOB_STATE_RUNNING, scheduler_key=public
        )
        await bus.publish(bus.topics.job("j-1"), message, retain=True)
        code, details = await until_taken(proc.address)
        assert code == grpc.StatusCode.PERMISSION_DENIED and "round ticket" in details, details
        forged = Ed25519PrivateKey.generate()
        code, details = await reduce(proc.address, round="forged", ticket=forged)
        assert code == grpc.StatusCode.PERMISSION_DENIED, details
        # A member's: taken, and it waits for sender 1, which never comes.
        code, details = await reduce(proc.address, round="member", ticket=key)
        assert code == grpc.StatusCode.ABORTED and "waiting for senders [1]" in details, details


@pytest.mark.attack("43.4")
async def test_what_it_holds_is_bounded_by_max_memory_bytes(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    """Parts held at once stay within --max-memory-bytes: one past what is free is refused by
    name, and what a call held is given back when it ends."""
    part = torch.ones(3 * MiB // 16, dtype=torch.float64)  # 1.5 MiB
    limit = 2 * MiB
    async with (
        scheduler_bus(broker) as bus,
        aggregator(broker, tmp_path, "--max-memory-bytes", str(limit)) as proc,
    ):
        assert metrics(proc)["swarm_aggregator_memory_limit_bytes"][0].value == limit
        await announce_job(bus, cpb.JOB_STATE_RUNNING)
        await until_taken(proc.address)
        too_big = torch.ones(limit // 8 + 1, dtype=torch.float64)
        code, details = await reduce(proc.address, values=too_big)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-memory-bytes" in details
        waiting = asyncio.create_task(
            reduce(proc.address, round="held", values=part, timeout_s=60.0)
        )
        async with asyncio.timeout(WAIT_S):
            while held(proc) < part.nbytes:  # it holds the first, waiting for sender 1
                await asyncio.sleep(0.05)
        code, details = await reduce(proc.address, round="second", values=part)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-memory-bytes" in details and "in use" in details
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        async with asyncio.timeout(WAIT_S):
            while held(proc) > 0:  # given back when the call ended
                await asyncio.sleep(0.05)


def test_a_memory_bound_that_holds_no_chunk_is_refused(tmp_path: Path) -> None:
    from tests.support.cli import swarm

    result = swarm(
        "aggregator",
        "--broker",
        "mqtt://127.0.0.1:1",
        "--max-memory-bytes",
        "1000",
        env={"SWARM_CACHE_DIR": str(tmp_path)},
        check=False,
        timeout=120,
    )
    assert result.returncode == 2 and "--max-memory-bytes 1000 is below" in result.stderr
    result = swarm(
        "aggregator",
        "--broker",
        "mqtt://127.0.0.1:1",
        "--bandwidth",
        "fast",
        env={"SWARM_CACHE_DIR": str(tmp_path)},
        check=False,
        timeout=120,
    )
    assert result.returncode == 2 and "--bandwidth" in result.stderr
    assert "'fast' is not a rate" in result.stderr


# -- rounds with an aggregator --------------------------------------------------------------------


WEIGHTS = (0.25, 0.25, 0.5)  # the aggregator (member 2) owns half of the vector


async def _pool_job(bus: Bus) -> None:
    await announce_job(bus, cpb.JOB_STATE_RUNNING, job=JOB)


async def test_an_aggregator_owns_a_part_of_a_real_round_float64_equal_to_the_plain_sum(
    open_broker: EmbeddedBroker, tmp_path: Path
) -> None:
    flats = [
        torch.randn(100_003, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
        for i in range(2)
    ]
    async with (
        scheduler_bus(open_broker) as bus,
        replicas(2) as pool,
        aggregator(open_broker, tmp_path, token=None) as proc,
    ):
        await _pool_job(bus)
        await until_taken(proc.address, job=JOB, token=None)
        group = [r.address for r in pool] + [proc.address]
        results = await reduce_all(
            pool, flats, group=group, parts=Parts(WEIGHTS, 2), round="with-agg"
        )
        for r in results:
            if isinstance(r, BaseException):
                raise r
            assert torch.equal(r, flats[0] + flats[1])  # c0 + c1, whoever owns the part
        (received,) = [
            s.value
            for s in metrics(proc, None)["swarm_aggregator_bytes_received"]
            if s.name.endswith("_total")
        ]
        owned = parts.part_bounds(flats[0].numel(), WEIGHTS)[2]
        assert received == 2 * (owned.stop - owned.start) * 8  # its part of both, no more


async def test_a_killed_aggregator_fails_its_round_by_name_and_the_retry_loses_nothing(
    open_broker: EmbeddedBroker, tmp_path: Path
) -> None:
    flats = [
        torch.randn(200_000, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
        for i in range(2)
    ]
    kept = [f.clone() for f in flats]
    async with (
        scheduler_bus(open_broker) as bus,
        replicas(2) as pool,
        aggregator(open_broker, tmp_path, token=None) as proc,
    ):
        await _pool_job(bus)
        await until_taken(proc.address, job=JOB, token=None)
        group = [r.address for r in pool] + [proc.address]
        settings = {"group": group, "parts": Parts(WEIGHTS, 2), "round": "doomed"}
        first = asyncio.create_task(members(pool, flats, [0], **settings))
        async with asyncio.timeout(WAIT_S):  # member 0's part is at the aggregator
            while held(proc, None) == 0:
                await asyncio.sleep(0.02)
        proc.kill()  # mid-round: member 1 has not even begun
        second = await members(pool, flats, [1], **settings)
        failed = [*await first, *second]
    for error in failed:
        assert isinstance(error, AveragingAborted), error
        assert 2 in error.missing, error  # the aggregator named
    assert all(torch.equal(f, k) for f, k in zip(flats, kept, strict=True))  # nothing lost
    retried = await _without_aggregator(flats)
    assert all(torch.equal(r, kept[0] + kept[1]) for r in retried)


async def test_without_bandwidth_it_measures_its_links_from_the_rounds_it_serves_and_says_so(
    open_broker: EmbeddedBroker, tmp_path: Path
) -> None:
    """No --bandwidth: it announces no rates until a round's streams tell them (`LinkMeter`, as
    a stage server's owner streams do), then announces them again, and /metrics shows them."""
    # 64 MiB vectors: its half comes in 32 MiB from each member and goes back as 32 MiB sums,
    # bursts past the meter's thresholds (1 MiB down, 16 MiB up).
    flats = [
        torch.randn(8 << 20, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
        for i in range(2)
    ]
    async with (
        scheduler_bus(open_broker) as bus,
        replicas(2) as pool,
        aggregator(open_broker, tmp_path, token=None) as proc,
    ):
        peers = bus.subscribe(Topics().peer("agg"))
        await peers.wait_subscribed(WAIT_S)
        said = await announcement(peers, cpb.PEER_STATE_SERVING)
        assert (said.upload_bytes_per_second, said.download_bytes_per_second) == (0.0, 0.0)
        await _pool_job(bus)
        await until_taken(proc.address, job=JOB, token=None)
        group = [r.address for r in pool] + [proc.address]
        half = (0.25, 0.25, 0.5)
        results = await reduce_all(pool, flats, group=group, parts=Parts(half, 2), round="measured")
        assert all(torch.equal(r, flats[0] + flats[1]) for r in results)
        async with asyncio.timeout(WAIT_S):  # announced again once measured (checked every 5 s)
            while not (said.upload_bytes_per_second > 0 and said.download_bytes_per_second > 0):
                said = await announcement(peers, cpb.PEER_STATE_SERVING)
        assert said.role == cpb.PEER_ROLE_AGGREGATOR and said.address == proc.address
        shown = {
            s.labels["direction"]: s.value
            for s in metrics(proc, None)["swarm_peer_link_bytes_per_second"]
        }
        assert shown["up"] > 0 and shown["down"] > 0, shown
        assert "link measured at" in proc.log()


async def members(
    pool: list[Replica], flats: list[torch.Tensor], indices: list[int], **kwargs: Any
) -> list[Any]:
    """The round of members `indices` of `pool` alone (the others run theirs apart)."""
    opts: dict[str, Any] = {
        "job": JOB,
        "stage": 0,
        "timeout_s": 20.0,
        "chunk_bytes": 4 * MiB,
        "max_bytes": 64 * MiB,
    } | kwargs
    calls = [
        all_reduce(
            flats[i],
            RoundSettings(index=i, **opts),
            averager=pool[i].averager,
            channels=pool[i].channels,
        )
        for i in indices
    ]
    return await asyncio.gather(*calls, return_exceptions=True)


async def _without_aggregator(flats: list[torch.Tensor]) -> list[torch.Tensor]:
    async with replicas(2) as pool:
        results = await reduce_all(pool, flats, round="retried")
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


async def test_a_hostile_aggregator_changes_only_the_part_it_owns_alike_on_every_member() -> None:
    """It answers its part's sum plus one: every member gets the same wrong part (so the pool
    stays identical, and a non-finite one is refused at the commit: test_nonfinite_rounds), and
    nothing outside its part changes (docs/decisions.md: what a pool checks of an aggregator)."""
    flats = [
        torch.randn(10_000, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
        for i in range(2)
    ]
    async with replicas(3) as pool:
        hostile = pool[2].averager
        honest = hostile.summer

        def wrong(
            values: list[torch.Tensor], owned: list[bool], codec: int, block_size: int
        ) -> Reduced:
            reduced = honest(values, owned, codec, block_size)
            reduced.tensor.add_(1.0)
            return reduced

        hostile.summer = wrong
        group = [r.address for r in pool]
        results = await reduce_all(
            pool[:2], flats, group=group, parts=Parts(WEIGHTS, 2), round="hostile"
        )
    exact = flats[0] + flats[1]
    owned = parts.part_bounds(exact.numel(), WEIGHTS)[2]
    for r in results:
        assert isinstance(r, torch.Tensor), r
        assert torch.equal(r, results[0])
        assert torch.equal(r[: owned.start], exact[: owned.start])
        assert torch.equal(r[owned], exact[owned] + 1.0)


def test_the_jobs_it_follows_from_their_announcements(caplog: pytest.LogCaptureFixture) -> None:
    """A running job's stages are taken, any other refused with why; a bad spec is said once,
    not at each of the job's announcements (one a step)."""
    jobs = PoolJobs()
    bad = cpb.JobAnnouncement(job="j", spec="[training\n", state=cpb.JOB_STATE_RUNNING)
    for _ in range(3):
        jobs.announced(bad)
    assert [r.levelname for r in caplog.records].count("ERROR") == 1
    with pytest.raises(NotFound, match="job 'j' is unknown here"):
        jobs.route("j", 0)
    jobs.announced(cpb.JobAnnouncement(job="j", spec=SPEC, state=cpb.JOB_STATE_STALLED))
    jobs.route("j", 1)  # a stalled job's other stages still average
    assert jobs.served() == (4 * MiB, 1 << 30, 3.0) and len(jobs) == 1  # SPEC's
    with pytest.raises(NotFound, match=r"has stages 0\.\.1, not 2"):
        jobs.route("j", 2)
    jobs.announced(cpb.JobAnnouncement(job="j", state=99))  # type: ignore[arg-type]
    with pytest.raises(NotFound, match="job j is in state 99"):
        jobs.route("j", 0)
    assert jobs.served() is None and len(jobs) == 0
