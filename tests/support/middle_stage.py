"""A live stage server in the test's process: stage 1 (the middle) of the tiny three-stage job,
on a real gRPC port, with the peer's default limits and `[runtime]` defaults (1 GiB tensors) and
no /metrics (the `job` and `server` fixtures, and `client`, a stage client of it; a test
folder's conftest makes them visible, a test file's own fixture of the same name wins)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from stage_server.server import RunningStageServer, StageServerOptions, start_stage_server
from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.rpc.stage_client import StageClient
from tests.support.jobs import make_job

__all__ = ["MIDDLE", "client", "job", "server"]

MIDDLE = 1
"""The stage `server` serves: neither the first (it takes hidden states) nor the last."""


@pytest.fixture
def job(tmp_path: Path) -> JobConfig:
    return make_job(tmp_path, training={"stages": 3})


@pytest.fixture
async def server(job: JobConfig) -> AsyncIterator[RunningStageServer]:
    running = await start_stage_server(job, StageServerOptions(stage=MIDDLE))
    try:
        yield running
    finally:
        await running.stop()


@pytest.fixture
async def client(job: JobConfig, server: RunningStageServer) -> AsyncIterator[StageClient]:
    """A client of `server`'s stage, as a trainer or the stage before holds one."""
    client = StageClient(server.address, job, fingerprint(job), MIDDLE)
    yield client
    await client.close()
