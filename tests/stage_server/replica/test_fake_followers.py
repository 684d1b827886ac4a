"""Fake followers against a live stage server (issue 44, N7): `DownloadState(follower=X)` calls
that hang up after one message, or that take the state and never ask for its updates, do not
keep the places of the peers copying this replica, and downloads whose readers stopped reading
do not keep the places of the downloads served at once: a real joiner still gets the state and
its updates."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from stage_server.peer.limits import PeerLimits
from stage_server.server import RunningStageServer, StageServerOptions, start_stage_server
from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.proto import stage_pb2 as pb
from swarm.proto import stage_pb2_grpc
from swarm.rpc import state_streams
from swarm.rpc.stage_client import StageClient
from tests.support.jobs import WIDE, make_job
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.timeout(120), pytest.mark.attack("N7")]


# `job` and `server` (conftest): the peer's default limits, 4 followers at once, each kept
# 600 s unheard.


def _request(job: JobConfig, follower: str) -> pb.StageDownloadStateRequest:
    return pb.StageDownloadStateRequest(
        job=fingerprint(job), stage=1, include_optimizer=True, follower=follower
    )


async def _real_joiner(server: RunningStageServer, job: JobConfig) -> None:
    """A joining peer's copy, as `stage_server.replica.copying` makes it: the state as a follower,
    then the updates since."""
    client = StageClient(server.address, job, fingerprint(job), 1)
    try:
        expect = server.runtime.checks.state
        step, state = await asyncio.wait_for(
            client.download_state(True, "", follower="peer-real", expect=expect), 20
        )
        assert state and step == server.runtime.step
        assert await client.updates("peer-real", step, expect=expect) == []
    finally:
        await client.close()


async def test_downloads_that_hang_up_after_one_message_keep_no_follower(
    server: RunningStageServer, job: JobConfig
) -> None:
    # Before the fix the four fakes held every place for 600 s: the real joiner was refused,
    # RESOURCE_EXHAUSTED "4 peers are copying this replica already ... (--max-followers 4)".
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = stage_pb2_grpc.StageServiceStub(channel)
        for i in range(4):
            call = stub.DownloadState(_request(job, f"peer-fake{i}"), timeout=20)
            assert (await call.read()).step == server.runtime.step  # one message, then gone
            call.cancel()
    transfer = server.servicer._transfer
    await wait_until(lambda: len(transfer.places) == 0, "the server saw each hang-up", timeout_s=5)
    await _real_joiner(server, job)


async def test_followers_that_never_ask_for_updates_are_let_go(
    server: RunningStageServer, job: JobConfig
) -> None:
    # Four fakes take the whole state, as a joiner does, and never ask for the updates after
    # it. A joiner asks as soon as its copy is loaded: one that has not within
    # `UpdateLog.FIRST_ASK_S` is let go (before the fix: kept for 600 s).
    log = server.runtime.updates
    log.first_ask_s = 1.0  # (the clock is real: a short wait instead of a minute)
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = stage_pb2_grpc.StageServiceStub(channel)
        for i in range(4):
            async for _ in stub.DownloadState(_request(job, f"peer-fake{i}"), timeout=20):
                pass
        sent = time.monotonic()  # each fake's state was sent before this
        # Within their first ask the fakes hold every place (judged only while that is sure).
        early = stub.DownloadState(_request(job, "peer-early"), timeout=20)
        refused: grpc.aio.AioRpcError | None = None
        try:
            await early.read()
        except grpc.aio.AioRpcError as e:
            refused = e
        early.cancel()  # a hang-up: had it been let in, its place is free at once
        if time.monotonic() - sent < log.first_ask_s:
            assert refused is not None and refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-followers 4" in str(refused.details()), refused.details()
    # Past the first ask of the last fake, and only just: each fake is let go by now.
    await asyncio.sleep(sent + log.first_ask_s + 0.05 - time.monotonic())
    await _real_joiner(server, job)


@contextlib.asynccontextmanager
async def _downloads_of(
    job: JobConfig,
) -> AsyncIterator[tuple[RunningStageServer, stage_pb2_grpc.StageServiceStub]]:
    """Stage 0 of `job` served, and a stub of it whose windows stay small (no BDP probe): a
    reader that stops reading stalls the sender."""
    running = await start_stage_server(job, StageServerOptions(stage=0))
    options = [("grpc.http2.bdp_probe", 0)]
    try:
        async with grpc.aio.insecure_channel(running.address, options=options) as channel:
            yield running, stage_pb2_grpc.StageServiceStub(channel)
    finally:
        await running.stop()


def _download(job: JobConfig) -> pb.StageDownloadStateRequest:
    return pb.StageDownloadStateRequest(job=fingerprint(job), stage=0, include_optimizer=True)


async def test_downloads_whose_readers_stall_give_their_places_to_a_joiner(
    tmp_path: Path,
) -> None:
    # Four callers start a download of a 32 MiB state, read one message and stop reading
    # without hanging up: each holds a place of --max-state-downloads (4). Their own client
    # would have given up after rpc_timeout_s without a byte, so a download whose reader took
    # nothing for that long gives its place to the next (before the fix: the joiner was
    # refused, "4 state downloads are being served already", for as long as they stayed).
    job = make_job(
        tmp_path,
        model=WIDE,
        runtime={"chunk_bytes": 256 << 10, "rpc_timeout_s": 1.0},
    )
    async with _downloads_of(job) as (running, stub):
        stalled = [stub.DownloadState(_download(job), timeout=60) for _ in range(4)]
        for call in stalled:
            await call.read()
        await asyncio.sleep(2.5)  # past rpc_timeout_s: none of them took a byte since
        # The joiner's own client waits longer for a byte than the server's 1 s: a 32 MiB
        # snapshot made on a loaded machine, or a scheduling pause, must not fail it (the
        # server still ends the stalled downloads after 1 s, which is what is tested).
        patient = replace(job, runtime=replace(job.runtime, rpc_timeout_s=60.0))
        client = StageClient(running.address, patient, fingerprint(job), 0)
        try:
            expect = running.runtime.checks.state
            step, state = await client.download_state(True, "", expect=expect)
            assert step == 0 and state
        finally:
            await client.close()
        for call in stalled:
            call.cancel()


async def test_a_stalled_download_lets_go_of_its_snapshot_with_nobody_else_asking(
    tmp_path: Path,
) -> None:
    # A stalled download gave its place back only when another download found every place
    # taken: until then it held its snapshot (a copy of the whole state, once the replica
    # applies an update before the snapshot is sent) for as long as its connection lived. Now
    # each part must be taken within rpc_timeout_s, as the reader's own client would wait.
    job = make_job(tmp_path, model=WIDE, runtime={"chunk_bytes": 256 << 10, "rpc_timeout_s": 1.0})
    async with _downloads_of(job) as (running, stub):
        stalled = stub.DownloadState(_download(job), timeout=60)
        await stalled.read()
        transfer = running.servicer._transfer
        assert len(transfer.places) == 1
        await wait_until(lambda: len(transfer.places) == 0, "the stalled download let go")
        stalled.cancel()


@contextlib.asynccontextmanager
async def _trickling(
    job: JobConfig, downloads: int = 1
) -> AsyncIterator[tuple[RunningStageServer, list[asyncio.Task[None]]]]:
    """A stage 0 server of `job` with `downloads` places for state downloads, each taken, in
    turn (0.3 s apart: the first the oldest), by a download naming no follower whose reader
    takes a chunk every 0.3 s (never idle for the job's 1 s); the tasks reading them."""
    opts = StageServerOptions(stage=0, limits=PeerLimits(max_state_downloads=downloads))
    running = await start_stage_server(job, opts)
    options = [("grpc.http2.bdp_probe", 0)]  # small windows: the reader paces the sender
    request = pb.StageDownloadStateRequest(job=fingerprint(job), stage=0, include_optimizer=True)
    readers: list[asyncio.Task[None]] = []
    try:
        async with grpc.aio.insecure_channel(running.address, options=options) as channel:
            stub = stage_pb2_grpc.StageServiceStub(channel)

            async def trickle() -> None:
                trickling = stub.DownloadState(request, timeout=120)
                while await trickling.read() is not grpc.aio.EOF:
                    await asyncio.sleep(0.3)

            try:
                for _ in range(downloads):
                    readers.append(asyncio.create_task(trickle()))
                    await asyncio.sleep(0.3)
                yield running, readers
            finally:
                for reader in readers:
                    reader.cancel()
                    with contextlib.suppress(BaseException):
                        await reader
    finally:
        await running.stop()


async def _copied(running: RunningStageServer, job: JobConfig, follower: str = "") -> None:
    """A download of the whole state (by `follower`, if named), its client patient for a byte."""
    patient = replace(job, runtime=replace(job.runtime, rpc_timeout_s=60.0))
    client = StageClient(running.address, patient, fingerprint(job), 0)
    try:
        expect = running.runtime.checks.state
        step, state = await client.download_state(True, "", follower=follower, expect=expect)
        assert step == 0 and state
    finally:
        await client.close()


async def _told_why(reader: asyncio.Task[None], why: str) -> None:
    """The trickling download ended at its next part, told `why`."""
    with pytest.raises(grpc.aio.AioRpcError) as ended:
        await asyncio.wait_for(reader, 20)
    assert ended.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert why in (ended.value.details() or ""), ended.value.details()


async def test_a_download_that_trickles_past_its_whole_bound_gives_its_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A reader that takes a chunk just inside every idle bound (rpc_timeout_s) kept its place
    # of --max-state-downloads for as long as it liked: the receiving side bounds a whole state
    # transfer (`STATE_MIN_RATE`, at least `STATE_FLOOR_S`), the serving side did not (before
    # the fix: "1 state downloads are being served already" for the 40 s it trickled). Here the
    # whole bound is 2 s; past it, the trickler gives its place to the next download.
    monkeypatch.setattr(state_streams, "STATE_MIN_RATE", 1 << 40)
    monkeypatch.setattr(state_streams, "STATE_FLOOR_S", 2.0)
    job = make_job(tmp_path, model=WIDE, runtime={"chunk_bytes": 256 << 10, "rpc_timeout_s": 1.0})
    async with _trickling(job) as (running, (reader,)):
        await asyncio.sleep(3.0)  # past the whole bound, still reading
        assert not reader.done()
        await _copied(running, job)
        await _told_why(reader, "ended this state download for another")


async def test_a_download_that_named_no_follower_gives_its_place_to_a_joiner(
    tmp_path: Path,
) -> None:
    # A review's repro: downloads that name no follower (anyone's with the token) held every
    # place of --max-state-downloads on equal terms with a joiner's copy, each restarted inside
    # its whole bound: the joiner was refused for as long as they went on. A follower (under a
    # scheduler, one its ticket names) now takes the place of the newest such download, which
    # is told why at its next part; the older one (a scheduler's checkpoint, long under way,
    # names none either) goes on.
    job = make_job(tmp_path, model=WIDE, runtime={"chunk_bytes": 256 << 10, "rpc_timeout_s": 1.0})
    async with _trickling(job, downloads=2) as (running, (older, newer)):
        await asyncio.sleep(0.3)  # well inside their whole bound
        assert not older.done() and not newer.done()
        await _copied(running, job, follower="peer-real")
        await _told_why(newer, "peer-real copies this replica")
        assert not older.done(), "the older download was cut"
