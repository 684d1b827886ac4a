"""`swarm scheduler` as started from the command line (issue 44, N4 and N11): its
`--admin-token-file`, `--max-jobs-per-submitter`, `--max-stage-bytes` and per-submitter
`--keep-finished-jobs`, and the memory a peer announces on its embedded broker, reach the job
API. One real process, real submitters over gRPC, a real peer announcement over MQTT."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from client.sdk import ClientError, SchedulerClient
from swarm.bus.connection import Bus
from swarm.local.procs import start_process, stop_all
from swarm.net.submitters import submitter_token
from swarm.proto import control_pb2 as cpb
from tests.support.jobs import write_job

ADMIN = "admin-token-for-the-test"
ALICE, BOB = submitter_token(ADMIN, "alice"), submitter_token(ADMIN, "bob")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


async def _code(call: object) -> str:
    try:
        await call  # type: ignore[misc]
    except ClientError as e:
        return f"{e.code}: {e}"
    return "OK"


async def _scenario(address: str, broker: str, tmp_path: Path) -> None:
    async with (
        SchedulerClient(address, submitter_token=ALICE, timeout_s=30.0) as alice,
        SchedulerClient(address, submitter_token=BOB, timeout_s=30.0) as bob,
    ):
        hers = (await alice.submit(write_job(tmp_path, "hers"))).job
        assert (await _code(alice.submit(write_job(tmp_path, "more")))).startswith(
            "RESOURCE_EXHAUSTED: 'alice' already has 1 unfinished job(s)"
        )
        assert (await _code(bob.cancel(hers))).startswith("PERMISSION_DENIED")
        huge = write_job(tmp_path, "huge", model={"d_model": 512, "n_heads": 8})
        said = await _code(bob.submit(huge))
        assert said.startswith("RESOURCE_EXHAUSTED") and "--max-stage-bytes" in said, said
        # A peer announces 1 MiB: a job of 1.5 MiB a stage, under --max-stage-bytes, is refused.
        async with Bus(broker, "peer-small", username="peer-small") as peer:
            announcement = cpb.PeerAnnouncement(
                peer="peer-small",
                address="127.0.0.1:1",
                device="cpu",
                state=cpb.PEER_STATE_DRAINING,  # not placed: only its memory matters here
                memory_bytes=1 << 20,
                time=time.time(),
            )
            await peer.publish(peer.topics.peer("peer-small"), announcement, retain=True)
            wider = write_job(tmp_path, "wider", model={"d_model": 64})
            for _ in range(300):
                said = await _code(bob.submit(wider))
                if said != "OK":
                    break
                await asyncio.sleep(0.1)
            assert "peer-small" in said and "1.0 MiB" in said, said
            offline = cpb.PeerAnnouncement(peer="peer-small", state=cpb.PEER_STATE_OFFLINE)
            await peer.publish(peer.topics.peer("peer-small"), offline, retain=True)
        # Retention per submitter (--keep-finished-jobs 1): bob's ends delete only bob's.
        await alice.cancel(hers)
        for name in ("b1", "b2"):
            await bob.cancel((await bob.submit(write_job(tmp_path, name))).job)
        for _ in range(300):
            left = {j.name for j in await bob.list()}
            if left == {"hers", "b2"}:
                break
            await asyncio.sleep(0.1)
        assert left == {"hers", "b2"}


def test_the_schedulers_flags_bind_submitters_and_sizes(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    admin_file = tmp_path / "admin-token"
    admin_file.write_text(ADMIN + "\n")
    args = ["scheduler", "--port", "0", "--store", str(tmp_path / "jobs.sqlite")]
    args += ["--checkpoint-dir", str(tmp_path / "ckpt"), "--data-root", str(tmp_path / "data")]
    args += ["--admin-token-file", str(admin_file), "--max-jobs-per-submitter", "1"]
    args += ["--max-stage-bytes", str(8 << 20), "--keep-finished-jobs", "1"]
    scheduler = start_process(args, log_dir=tmp_path, name="scheduler")
    try:
        ready = scheduler.wait_ready(120)
        asyncio.run(_scenario(ready["address"], ready["broker"], tmp_path))
        assert "Traceback" not in scheduler.log(), scheduler.log()[-3000:]
    finally:
        stop_all([scheduler])
