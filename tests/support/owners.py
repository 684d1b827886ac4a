"""The job API with named submitters (issue 44, N4): the swarm token, the scheduler's admin
token, alice's and bob's submitter tokens made from it, and the `api` fixture that serves the
job API so (import `owned_api` into a test module: it stands for the suite's plain `api`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from scheduler.callers import Callers
from swarm.net.submitters import admin_credential, submitter_token
from tests.support.api import RunningApi, start_api

__all__ = ["ADMIN", "ADMIN_TOKEN", "ALICE", "BOB", "TOKEN", "owned_api"]

TOKEN = "swarm-token"
ADMIN_TOKEN = "admin-token-of-the-scheduler"
ALICE, BOB = submitter_token(ADMIN_TOKEN, "alice"), submitter_token(ADMIN_TOKEN, "bob")
ADMIN = admin_credential(ADMIN_TOKEN)  # the admin's credential; the admin token stays home


@pytest.fixture(name="api")
async def owned_api(tmp_path: Path) -> AsyncIterator[RunningApi]:
    running = await start_api(tmp_path, token=TOKEN, callers=Callers(ADMIN_TOKEN, mutual=False))
    yield running
    await running.stop()
