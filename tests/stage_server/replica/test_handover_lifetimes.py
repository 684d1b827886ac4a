"""Issue 63, item 2: no share outlives the push that made it. Real stage servers in this
process (two stages, one site: the shared-memory handover between them). A push whose caller
gave up (its deadline passed) while the replica's worker was still computing used to leave its
outputs offered for ever: the worker made the offer after the call was cancelled, and nobody
released it (a segment in /dev/shm a push, on a GPU an allocation torch could never free).
Now a push's outgoing tensors are released when it ends, and one made after that at once."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from stage_server.server import RunningStageServer, StageServerOptions, start_stage_server
from swarm.device.shm_handover import PREFIX
from swarm.device.site import SHM_DIR
from swarm.errors import PeerUnavailable
from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.proto import stage_pb2 as pb
from swarm.rpc.push_call import PushCall
from swarm.rpc.stage_client import StageClient, WirePush
from swarm.wire import codec
from swarm.wire.crossing import Crossing
from tests.support.jobs import make_job
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(120)


def segments() -> list[str]:
    """This process's handover segments in /dev/shm."""
    mine = f"-{os.getpid()}-"
    return [n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX) and mine in n]


async def push(
    job: JobConfig, first: RunningStageServer, last: RunningStageServer, index: int, timeout: float
) -> None:
    client = StageClient(first.address, job, fingerprint(job), 0)
    micro = job.training.microbatch_size
    tokens = torch.randint(0, job.model.vocab_size, (micro, job.model.seq_len))
    try:
        call: WirePush = PushCall(
            0,
            index,
            Crossing(codec.encode(tokens, "inputs")),
            codec.encode(tokens, "targets"),
            route=(pb.Route(peers=[last.address], addresses=[last.address], throughput=[1.0]),),
        )
        await client.push(call, timeout=timeout)
    finally:
        await client.close()


def _pushes_ended(running: RunningStageServer) -> float:
    """The Pushes `running` has ended, whatever their status."""
    metrics = running.servicer.metrics
    return sum(
        metrics.registry.get_sample_value(
            "swarm_stage_requests_total", {**metrics.values, "method": "Push", "code": code}
        )
        or 0.0
        for code in ("OK", "CANCELLED", "DEADLINE_EXCEEDED", "UNAVAILABLE")
    )


async def test_outputs_made_after_their_push_was_abandoned_are_released(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = make_job(tmp_path, training={"stages": 2}, runtime={"data_plane": "push"})
    first = await start_stage_server(job, StageServerOptions(stage=0))
    last = await start_stage_server(job, StageServerOptions(stage=1))
    try:
        await push(job, first, last, 0, 30)  # stage 1 answers its site: the next is handed over
        assert segments() == []
        # Stage 0's forward is held until the caller gave up (its deadline passed and the
        # call was cancelled); then the worker encodes and offers the outputs.
        rt, given_up = first.runtime, threading.Event()
        forward = rt.forward

        def held(*args: Any, **kwargs: Any) -> torch.Tensor:
            assert given_up.wait(60)
            return forward(*args, **kwargs)

        monkeypatch.setattr(rt, "forward", held)
        with pytest.raises(PeerUnavailable):
            await push(job, first, last, 1, 0.5)
        given_up.set()
        await first.servicer.worker.run(lambda: None)  # the worker has done with that push
        # The server ends the push as its cancellation reaches it: under load, after the
        # caller gave up (CI: checked before it had, the push still going on to stage 1).
        await wait_until(lambda: _pushes_ended(first) >= 2, "the abandoned push ended")
        await asyncio.sleep(0)
        assert segments() == [], "nothing is left offered by a push that ended"
    finally:
        await first.stop()
        await last.stop()
