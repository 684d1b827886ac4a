"""A refusal whose status a grpc-aio write lost, nothing told ahead (`swarm.rpc.lost_status`):
asked again of the same real stage server by one probe. The race itself is grpc's and comes
about 1 call in 100 of 30 refused at once on a loaded machine (3 of 300 in one suite run of
tests/stage_server/test_token_refusals_told.py, which the stage client's boundary now passes
through this); its error is what grpc-aio makes of it, built here as it builds it
(`set_internal_error`: INTERNAL, "Internal error from Core", no metadata)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from stage_server.peer.limits import PeerLimits
from stage_server.server import RunningStageServer, StageServerOptions, start_stage_server
from swarm.errors import PeerUnavailable, RemoteError, SwarmError
from swarm.job.fingerprint import fingerprint
from swarm.net.told_ahead import RACE_DETAILS, TOLD_CODE_KEY, TOLD_DETAILS_KEY
from swarm.rpc.lost_status import PROBE_S, asked_again, lost
from swarm.rpc.stage_client import StageClient
from tests.support.jobs import make_job

pytestmark = pytest.mark.timeout(60)

RACED = grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, (), (), RACE_DETAILS)


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[tuple[RunningStageServer, Path]]:
    job = make_job(tmp_path, training={"stages": 2})
    options = StageServerOptions(stage=0, token="the-token", limits=PeerLimits())
    running = await start_stage_server(job, options)
    try:
        yield running, tmp_path
    finally:
        await running.stop()


async def _error_of(
    running: RunningStageServer, tmp_path: Path, token: str | None, closed: bool = False
) -> SwarmError:
    """What the stage client's boundary makes of the race's error on a call to `running`."""
    job = make_job(tmp_path, training={"stages": 2})
    client = StageClient(running.address, job, fingerprint(job), 0, token)
    try:
        if closed:
            await client.close()
        return await client.error_of(RACED, client.timeout_s)
    finally:
        await client.close()


async def test_a_lost_refusal_of_the_token_is_what_a_probe_is_told(
    server: tuple[RunningStageServer, Path],
) -> None:
    error = await _error_of(*server, token=None)
    assert isinstance(error, RemoteError) and error.code == "UNAUTHENTICATED", error
    assert "this swarm needs its token" in str(error) and "a probe" in str(error), error


async def test_a_probe_answered_leaves_the_internal_and_says_so(
    server: tuple[RunningStageServer, Path],
) -> None:
    error = await _error_of(*server, token="the-token")
    assert isinstance(error, RemoteError) and error.code == "INTERNAL", error
    assert "was answered" in str(error), error


async def test_a_server_gone_or_a_client_closed_is_unavailable(
    server: tuple[RunningStageServer, Path],
) -> None:
    running, tmp_path = server
    closed = await _error_of(running, tmp_path, token="the-token", closed=True)
    assert isinstance(closed, PeerUnavailable) and "closed before a probe" in str(closed), closed
    await running.stop()
    gone = await _error_of(running, tmp_path, token="the-token")
    assert isinstance(gone, PeerUnavailable) and "a probe" in str(gone), gone


async def test_a_probe_takes_no_more_than_the_call_had_left() -> None:
    """Asked within what is left of the call's deadline, at most `PROBE_S`; nothing left, not
    asked (a server that answers its own INTERNAL of the race's text holds up no caller)."""
    asked: list[float] = []

    async def probe(timeout: float) -> object:
        asked.append(timeout)
        return None

    assert (await asked_again(RACED, probe, 1.5)).code() == grpc.StatusCode.INTERNAL  # type: ignore[attr-defined]
    assert (await asked_again(RACED, probe, 60.0)).code() == grpc.StatusCode.INTERNAL  # type: ignore[attr-defined]
    left = await asked_again(RACED, probe, 0.0)
    assert asked == [1.5, PROBE_S]
    assert "no time was left" in left.details()  # type: ignore[attr-defined]


def test_only_the_race_with_nothing_told_is_lost() -> None:
    assert lost(RACED)
    told = ((TOLD_CODE_KEY, "UNAUTHENTICATED"), (TOLD_DETAILS_KEY, b"no token"))
    assert not lost(grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, told, (), RACE_DETAILS))
    assert not lost(grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, (), (), "a server's own"))
    assert not lost(grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, (), (), RACE_DETAILS))
