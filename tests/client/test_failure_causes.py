"""Every failure names its cause, and nothing retries forever (issue 63, items 3 and 4; DESIGN.md,
"Failures say why"). Real gRPC stage servers in this process; the last stage refuses every call
with one status, as a replica that cannot take a handover did on a GPU: the refusal's code and
text reach the trainer (on the push plane through stage 0's next hop, one cause nested in the
next), the first failure behind each backoff is a WARNING (once per peer and cause in the rate
window), and a standalone trainer whose steps stop committing stops after the job's
`runtime.patience_s`, exiting non-zero with the cause."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from client.patience import NoProgress
from client.standalone import train_standalone
from swarm.errors import FailedPrecondition
from tests.support.cli import swarm as swarm_cli
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


@pytest.mark.parametrize("plane", ["push", "relay"])
async def test_a_refusal_reaches_the_trainer_with_its_code_and_text(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, plane: str
) -> None:
    caplog.set_level(logging.WARNING)
    job = make_job(tmp_path, training=TRAINING, runtime={**RUNTIME, "data_plane": plane})
    swarm = Swarm(job)
    try:
        first, last = await swarm.add(0), await swarm.add(1)
        refusing = Refusing(last, FailedPrecondition(REFUSAL))
        with pytest.raises(NoProgress) as stopped:
            await asyncio.wait_for(train_standalone(job, swarm.members()), 60)
    finally:
        await swarm.close()
    said = str(stopped.value)
    assert refusing.refused >= 2, "the last stage was tried again after its backoff"
    assert "no step committed for 3 s (runtime.patience_s)" in said, said
    assert f"peer {last.address}: FAILED_PRECONDITION: {REFUSAL}" in said, said
    # the first failure behind a backoff is a WARNING, once per peer and cause in its window
    at_stage_1 = _warnings(caplog, f"stage 1: {last.address} failed: FAILED_PRECONDITION")
    assert len(at_stage_1) == 1 and REFUSAL in at_stage_1[0] and "backoff" in at_stage_1[0]
    at_stage_0 = _warnings(caplog, f"stage 0: {first.address} failed: UNAVAILABLE")
    if plane == "push":  # stage 0's failure, as the trainer saw it, carries stage 1's
        assert f"peer {first.address}: UNAVAILABLE: no replica took the microbatch: stage 1" in (
            said
        )
        assert len(at_stage_0) == 1 and REFUSAL in at_stage_0[0], at_stage_0
    else:  # the trainer called stage 1 itself
        assert said.startswith("no step committed") and "the last failure: stage 1: " in said
        assert at_stage_0 == []
    failed = [r for r in caplog.records if r.name == "client.trainer" and "failed" in r.msg]
    assert len(failed) == 1, "the trainer's failed microbatches: once a window for each cause"
    assert not any("banned" in r.getMessage() for r in caplog.records), "backoff is no ban"


@pytest.mark.slow  # a process of its own
async def test_swarm_trainer_exits_non_zero_naming_the_cause(tmp_path: Path) -> None:
    path = write_job(tmp_path, "test", training=TRAINING, runtime=RUNTIME)
    swarm = Swarm(make_job(tmp_path, training=TRAINING, runtime=RUNTIME))
    try:
        await swarm.add(0)
        Refusing(await swarm.add(1), FailedPrecondition(REFUSAL))
        servers = ",".join(s[0].address for s in swarm.servers)
        argv = ["trainer", "--job", str(path), "--stage-servers", servers]
        # its own process (the servers answer on this loop meanwhile), killed if it retries on
        done = await asyncio.to_thread(swarm_cli, *argv, timeout=60, check=False)
    finally:
        await swarm.close()
    assert done.returncode != 0
    assert "no step committed for 3 s" in done.stderr, done.stderr[-3000:]
    assert f"FAILED_PRECONDITION: {REFUSAL}" in done.stderr.splitlines()[-1], done.stderr[-3000:]
