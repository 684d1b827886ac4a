"""Bind one address, announce another, with real processes: stage servers and a scheduler listening
on every interface announce the address given (`--announce-host`) and work end to end. The checks
without processes: tests/swarm/net/test_addresses.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from client.sdk import SchedulerClient
from swarm.job.config import load_job
from swarm.job.fingerprint import fingerprint
from swarm.local.procs import SwarmProcess, start_process, stop_all
from swarm.rpc.stage_client import StageClient
from tests.support.jobs import write_job


def _server(tmp_path: Path, *flags: str) -> SwarmProcess:
    job = write_job(tmp_path)
    args = ["stage-server", "--job", str(job), "--stage", "1", "--port", "0", *flags]
    args.append("--insecure-no-token")  # every interface, no token: meant here (a test's own)
    return start_process(args, log_dir=tmp_path, name="-".join(["s", *flags]).replace(":", "_"))


async def _info_at(address: str, tmp_path: Path) -> int:
    job = load_job(write_job(tmp_path))
    client = StageClient(address, job, fingerprint(job), 1)
    try:
        return (await client.info()).stage
    finally:
        await client.close()


@pytest.mark.slow
def test_a_stage_server_on_every_interface_announces_the_address_given(tmp_path: Path) -> None:
    refused = _server(tmp_path, "--host", "0.0.0.0")
    assert refused.proc.wait(60) == 2
    assert "would announce an address nobody can dial" in refused.log()
    servers = [
        _server(tmp_path, "--host", "0.0.0.0", "--announce-host", "127.0.0.1"),
        _server(tmp_path, "--host", "::", "--announce-host", "::1"),
        _server(tmp_path, "--host", "::1"),
    ]
    try:
        for s in servers:
            s.wait_ready(120)
        v4, v6, loop6 = (s.address for s in servers)
        assert v4.startswith("127.0.0.1:")
        assert v6.startswith("[::1]:") and loop6.startswith("[::1]:")
        for address in (v4, v6, loop6):  # each answers where it says it is
            assert asyncio.run(_info_at(address, tmp_path)) == 1
    finally:
        stop_all(servers)


async def _jobs_at(address: str) -> list[str]:
    async with SchedulerClient(address) as client:
        return [status.job for status in await client.list()]


@pytest.mark.slow
def test_a_scheduler_on_every_interface_announces_its_api_and_broker(tmp_path: Path) -> None:
    common = ["scheduler", "--port", "0", "--store", str(tmp_path / "jobs.sqlite")]
    common += ["--checkpoint-dir", str(tmp_path / "ckpt"), "--host", "0.0.0.0"]
    common += ["--insecure-no-token"]  # every interface, no token: meant here
    (tmp_path / "data").mkdir()
    common += ["--data-root", str(tmp_path / "data")]
    refused = start_process(common, log_dir=tmp_path, name="refused")
    assert refused.proc.wait(60) == 2
    assert "the scheduler would announce an address nobody can dial" in refused.log()
    scheduler = start_process([*common, "--announce-host", "127.0.0.1"], log_dir=tmp_path)
    try:
        ready = scheduler.wait_ready(120)
        assert ready["address"].startswith("127.0.0.1:")
        assert ready["broker"].startswith("mqtt://127.0.0.1:")
        assert asyncio.run(_jobs_at(ready["address"])) == []  # its job API answers there
    finally:
        stop_all([scheduler])
