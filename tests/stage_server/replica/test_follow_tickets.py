"""Only the coordinator names followers (issue 44, N7): a replica the scheduler placed keeps
updates only for a follower the scheduler's ticket names (`swarm.net.follow_tickets`), given
to the joiner with its signed `Join`. A token holder that names itself, or a real joiner, a
follower is refused, PERMISSION_DENIED: it can neither hold a place of `--max-followers` (four
fakes that download the state and then ask for its updates, as a copy does, would hold every
place for as long as they go on) nor move or end a real joiner's registration. The real joiner,
named by the real coordinator, still copies, joins and stays bitwise identical. A plain
download (no follower) stays open to token holders, bounded by `--max-state-downloads`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from scheduler.coordinator import LocalCoordinator
from scheduler.coordinator.replicas import grpc_replicas
from stage_server.server import RunningStageServer, StageServerOptions, start_stage_server
from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.net.commit_auth import SchedulerKey
from swarm.ops.progress import StepRecord
from swarm.proto import control_pb2 as cpb
from swarm.proto import stage_pb2 as pb
from swarm.proto import stage_pb2_grpc
from tests.support.inprocess import Swarm, lease_after_joined
from tests.support.jobs import make_job

pytestmark = [pytest.mark.timeout(180), pytest.mark.attack("N7")]


def _placed(server: RunningStageServer, job_id: str, key: SchedulerKey) -> None:
    """`server` as the scheduler placed it: it learned the key from the job's announcement."""
    server.servicer.trust(cpb.JobAnnouncement(job=job_id, scheduler_key=key.public))


def _download(job_id: str, stage: int, follower: str, ticket: bytes = b"") -> Any:
    request = pb.StageDownloadStateRequest(
        job=job_id, stage=stage, include_optimizer=True, follower=follower
    )
    if ticket:
        request.ticket = ticket
    return request


async def _code(call: Any) -> grpc.StatusCode:
    """The status `call` (a stream) ends with, read to its end."""
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


@pytest.fixture
async def placed(
    tmp_path: Path,
) -> AsyncIterator[tuple[RunningStageServer, JobConfig, SchedulerKey]]:
    job = make_job(tmp_path, training={"stages": 3})
    running = await start_stage_server(job, StageServerOptions(stage=1))
    key = SchedulerKey.generate()
    _placed(running, fingerprint(job), key)
    yield running, job, key
    await running.stop()


async def test_a_token_holder_names_no_follower_of_a_replica_the_scheduler_placed(
    placed: tuple[RunningStageServer, JobConfig, SchedulerKey],
) -> None:
    server, job, key = placed
    job_id, me, log = fingerprint(job), server.servicer.peer, server.runtime.updates
    other = SchedulerKey.generate()
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = stage_pb2_grpc.StageServiceStub(channel)
        # No ticket; a ticket of another key; one for another follower, another source,
        # another stage: each refused, and no follower is kept.
        refused = [
            _download(job_id, 1, "peer-fake"),
            _download(job_id, 1, "peer-fake", other.ticket(job_id, 1, "peer-fake", me)),
            _download(job_id, 1, "peer-fake", key.ticket(job_id, 1, "peer-real", me)),
            _download(job_id, 1, "peer-fake", key.ticket(job_id, 1, "peer-fake", "elsewhere")),
            _download(job_id, 1, "peer-fake", key.ticket(job_id, 2, "peer-fake", me)),
            _download(job_id, 1, "peer-fake", b"\0" * 7),
        ]
        codes = [await _code(stub.DownloadState(r, timeout=20)) for r in refused]
        # Before: each was served, and the first four held every place of --max-followers.
        assert codes == [grpc.StatusCode.PERMISSION_DENIED] * len(refused)
        assert log._followers == {}

        # The follower the scheduler named copies; a token holder can neither move nor end
        # its registration (Updates naming it, without its ticket).
        ticket = key.ticket(job_id, 1, "peer-real", me)
        assert await _code(stub.DownloadState(_download(job_id, 1, "peer-real", ticket))) == (
            grpc.StatusCode.OK
        )
        for step in (-1, server.runtime.step + 5):
            forged = pb.StageUpdatesRequest(
                job=job_id, stage=1, follower="peer-real", from_step=step
            )
            assert (
                await _code(stub.Updates(forged, timeout=20)) == grpc.StatusCode.PERMISSION_DENIED
            )
        assert list(log._followers) == ["peer-real"]
        asked = pb.StageUpdatesRequest(
            job=job_id, stage=1, follower="peer-real", from_step=server.runtime.step, ticket=ticket
        )
        assert await _code(stub.Updates(asked, timeout=20)) == grpc.StatusCode.OK

        # A plain download (no follower: a checkpoint, an export) needs no ticket.
        assert await _code(stub.DownloadState(_download(job_id, 1, ""), timeout=20)) == (
            grpc.StatusCode.OK
        )


class _FakeFollowers:
    """Token holders that name themselves followers of `server` and then behave as copies do:
    they take the state and ask for its updates every fraction of a second, so no rule about
    silent or early-ending followers lets them go."""

    def __init__(self, server: RunningStageServer, job_id: str, count: int) -> None:
        self.codes: list[grpc.StatusCode] = []
        self._channel = grpc.aio.insecure_channel(server.address)
        stub = stage_pb2_grpc.StageServiceStub(self._channel)
        stage = server.runtime.stage
        self.tasks = [
            asyncio.create_task(self._follow(stub, job_id, stage, f"peer-fake{i}"))
            for i in range(count)
        ]

    async def _follow(self, stub: Any, job_id: str, stage: int, name: str) -> None:
        step = -1
        try:
            async for part in stub.DownloadState(_download(job_id, stage, name), timeout=20):
                step = max(step, part.step)
            self.codes.append(grpc.StatusCode.OK)
            while True:
                asking = pb.StageUpdatesRequest(
                    job=job_id, stage=stage, follower=name, from_step=step
                )
                async for _ in stub.Updates(asking, timeout=20):
                    pass
                await asyncio.sleep(0.2)
        except grpc.aio.AioRpcError as e:
            self.codes.append(e.code())

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._channel.close()


@pytest.mark.slow
async def test_the_joiner_the_coordinator_names_joins_past_fake_followers_and_stays_exact(
    tmp_path: Path, make_swarm: list[Swarm]
) -> None:
    job = make_job(tmp_path, training={"steps": 8, "target_batch_size": 32})
    job_id, key = fingerprint(job), SchedulerKey.generate()
    swarm = Swarm(job)
    make_swarm.append(swarm)
    await swarm.add_replicas(1)
    for stage in swarm.servers:
        _placed(stage[0], job_id, key)
    joined: list[RunningStageServer] = []
    fakes: list[_FakeFollowers] = []

    async def after_step(record: StepRecord) -> None:
        if record.step == 1:  # every place of stage 2's only replica taken, then a joiner
            source = swarm.servers[2][0]
            fakes.append(_FakeFollowers(source, job_id, source.servicer.limits.peer.max_followers))
            await asyncio.wait(fakes[0].tasks, timeout=5)  # each took the state, or was refused
            joiner = await swarm.add(2)
            _placed(joiner, job_id, key)
            joined.append(joiner)

    coordinator = LocalCoordinator(
        job,
        job_id,
        swarm.members,
        on_step=after_step,
        connect=grpc_replicas(job, job_id, signing=key),
    )
    lease_after_joined(coordinator, joined, 5, timeout_s=60.0)
    try:
        # Before: the fakes took every place; the joiner's copies were refused, "4 peers are
        # copying this replica already", and it never joined (no member 60 s after step 5).
        await swarm.train(coordinator, trainers=1)
    finally:
        for f in fakes:
            await f.close()
    assert fakes and fakes[0].codes == [grpc.StatusCode.PERMISSION_DENIED] * len(fakes[0].tasks)
    assert joined and joined[0].runtime.step == 8
    swarm.assert_replicas_identical()  # bitwise
    samples = joined[0].servicer.metrics.registry.get_sample_value(
        "swarm_stage_samples_total", dict(joined[0].servicer.metrics.values)
    )
    assert samples and samples > 0  # it worked as a member
    await coordinator.close()
