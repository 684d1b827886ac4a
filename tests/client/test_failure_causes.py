"""Every failure names its cause, and nothing retries forever (issue 63, items 3 and 4; DESIGN.md,
"Failures say why"). Real gRPC stage servers in this process; the last stage refuses every push
with one status, as a replica that cannot take a handover did on a GPU: the refusal's code and
text reach the trainer through stage 0's next hop, the first failure behind each backoff is a
WARNING (once per peer and cause in the rate window), and a standalone trainer whose steps stop
committing stops after the job's `runtime.patience_s`, exiting non-zero with the cause."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from client.patience import NoProgress
from client.standalone import train_standalone
from swarm.cli import main
from swarm.errors import FailedPrecondition
from tests.support.inprocess import Swarm
from tests.support.jobs import make_job, write_job
from tests.support.refusing import Refusing

pytestmark = pytest.mark.timeout(120)

REFUSAL = "handover refused: a malformed CUDA handover (66 bytes)"
TRAINING = {"stages": 2, "steps": 3, "target_batch_size": 4}  # one microbatch a step
RUNTIME = {"data_plane": "push", "patience_s": 3.0}


def _warnings(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and r.name == "swarm.rpc.causes" and text in r.getMessage()
    ]


async def test_a_refusal_two_hops_away_reaches_the_trainer_with_its_code_and_text(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    job = make_job(tmp_path, training=TRAINING, runtime=RUNTIME)
    swarm = Swarm(job)
    try:
        first, last = await swarm.add(0), await swarm.add(1)
        refusing = Refusing(last, FailedPrecondition(REFUSAL))
        with pytest.raises(NoProgress) as stopped:
            await asyncio.wait_for(train_standalone(job, swarm.members()), 60)
    finally:
        await swarm.close()
    said = str(stopped.value)
    assert refusing.refused >= 2, "stage 0's next hop tried the last stage again after backoff"
    assert "no step committed for 3 s (runtime.patience_s)" in said, said
    # stage 0's failure, as the trainer saw it, carries stage 1's: peer, code and text
    assert f"peer {first.address}: UNAVAILABLE: no replica took the microbatch: stage 1" in said
    assert f"peer {last.address}: FAILED_PRECONDITION: {REFUSAL}" in said, said
    # the first failure behind a backoff is a WARNING, once per peer and cause in its window
    at_stage_1 = _warnings(caplog, f"stage 1: {last.address} failed: FAILED_PRECONDITION")
    assert len(at_stage_1) == 1 and REFUSAL in at_stage_1[0] and "backoff" in at_stage_1[0]
    at_stage_0 = _warnings(caplog, f"stage 0: {first.address} failed: UNAVAILABLE")
    assert len(at_stage_0) == 1 and REFUSAL in at_stage_0[0], at_stage_0
    assert not any("banned" in r.getMessage() for r in caplog.records), "backoff is no ban"


async def test_swarm_trainer_exits_non_zero_naming_the_cause(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_job(tmp_path, "test", training=TRAINING, runtime=RUNTIME)
    swarm = Swarm(make_job(tmp_path, training=TRAINING, runtime=RUNTIME))
    try:
        await swarm.add(0)
        Refusing(await swarm.add(1), FailedPrecondition(REFUSAL))
        servers = ",".join(s[0].address for s in swarm.servers)
        argv = ["trainer", "--job", str(path), "--stage-servers", servers]
        code = await asyncio.wait_for(asyncio.to_thread(main, argv), 60)
    finally:
        await swarm.close()
    err = capsys.readouterr().err
    assert code != 0
    assert "no step committed for 3 s" in err and f"FAILED_PRECONDITION: {REFUSAL}" in err, err
