"""Submitters on the command line (issue 44, N4): `swarm submitter-token NAME` makes a submitter's
token from the admin token, and the job commands send it (`--submitter-token-file`,
`SWARM_SUBMITTER_TOKEN`), against a real job API server."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from unittest import mock

import pytest

from scheduler.callers import Callers
from swarm.cli import load, parse
from swarm.errors import ConfigError
from swarm.flags import env_name
from swarm.net.submitters import admin_credential, submitter_of, submitter_token
from tests.support.api import RunningApi, start_api
from tests.support.jobs import write_job

ADMIN = "the-admin-token"

pytestmark = pytest.mark.timeout(60)


async def swarm(*argv: str, env: dict[str, str] | None = None) -> int:
    """`swarm ARGV` as `swarm.cli` parses and runs it, with only `env`'s SWARM_ variables."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_")}
    environ |= {env_name(flag): value for flag, value in (env or {}).items()}
    with mock.patch.dict(os.environ, environ, clear=True):
        args = parse(list(argv))
        return int(await asyncio.to_thread(load(args.command).run, args.command, args))


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[RunningApi]:
    running = await start_api(tmp_path, callers=Callers(ADMIN, mutual=False))
    yield running
    await running.stop()


async def test_tokens_made_by_the_command_name_their_submitters_to_the_job_commands(
    api: RunningApi, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    admin_file = tmp_path / "admin-token"
    admin_file.write_text(ADMIN + "\n")
    files = {}
    for name in ("alice", "bob"):
        assert await swarm("submitter-token", name, "--admin-token-file", str(admin_file)) == 0
        token = capsys.readouterr().out.strip()
        assert submitter_of(ADMIN, token) == name
        files[name] = tmp_path / f"{name}.token"
        files[name].write_text(token + "\n")
    at = ("--scheduler", api.address)
    alice = ("--submitter-token-file", str(files["alice"]))
    assert await swarm("submit", str(write_job(tmp_path, "idle")), *at, *alice) == 0
    job = capsys.readouterr().out.strip()
    assert await swarm("status", job, "--json", *at) == 0  # anyone reads it
    assert json.loads(capsys.readouterr().out)["submitter"] == "alice"
    assert await swarm("jobs", *at) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split()[-1] == "SUBMITTER" and row.split()[-1] == "alice"
    bob = {"submitter-token": files["bob"].read_text().strip()}  # SWARM_SUBMITTER_TOKEN
    assert await swarm("cancel", job, *at, env=bob) == 1
    err = capsys.readouterr().err
    assert "submitted by 'alice'" in err and "'bob'" in err
    # The admin's credential, made from the admin token (which never leaves its machine).
    assert await swarm("submitter-token", "admin", "--admin-token-file", str(admin_file)) == 0
    credential = capsys.readouterr().out.strip()
    assert ADMIN not in credential and submitter_of(ADMIN, credential) == "admin"
    assert await swarm("cancel", job, *at, "--submitter-token-file", str(admin_file)) == 1
    assert "swarm submitter-token admin" in capsys.readouterr().err
    assert await swarm("cancel", job, *at, env={"submitter-token": credential}) == 0
    assert api.control.cancelled_ids == [job]


async def test_the_admins_name_is_no_submitters_and_the_admin_token_is_needed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    admin_file = tmp_path / "admin-token"
    admin_file.write_text(ADMIN)
    # `admin` gives the admin's own credential (issue 54), no submitter's token
    assert await swarm("submitter-token", "admin", "--admin-token-file", str(admin_file)) == 0
    assert capsys.readouterr().out.strip() == admin_credential(ADMIN)
    with pytest.raises(ConfigError, match="the admin's own"):
        submitter_token(ADMIN, "admin")  # as an invite would make it
    with pytest.raises(ConfigError, match="--admin-token-file"):
        await swarm("submitter-token", "alice")
