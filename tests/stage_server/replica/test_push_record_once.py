"""A push-plane record is made once for a run of a microbatch (`stage_server.replica.push_records`):
a later push of the same run to the same replica is turned away while the first is kept, and a
push that failed leaves no record behind, so its retry makes its own.

Before, a second push of a run replaced the first one's record. A hostile member of the push's
path knows the run's id (it is passed on along the path), and could push again, with other
inputs, to an honest replica the run went through: the trainer then asked for and audited a
record of inputs that replica never accumulated from, and its re-execution convicted it. Real
stage servers on real ports."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from stage_server.replica.push_records import PushRecords
from stage_server.server import RunningStageServer, StageServerOptions, start_stage_server
from swarm.errors import ActivationsNotCached, Busy, PeerUnavailable
from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.proto import stage_pb2 as pb
from swarm.rpc.push_call import PushCall
from swarm.rpc.stage_client import StageClient, WirePush
from swarm.wire.crossing import Crossing
from swarm.wire.digest import digest
from tests.support.jobs import make_job

pytestmark = pytest.mark.timeout(60)

RUN = 7  # the trainer's id of the microbatch's run


@pytest.fixture
async def servers(tmp_path: Path) -> AsyncIterator[tuple[JobConfig, list[RunningStageServer]]]:
    """Stages 1 and 2 of a three-stage push-plane job that audits every microbatch."""
    job = make_job(
        tmp_path,
        training={"stages": 3},
        runtime={"data_plane": "push", "rpc_timeout_s": 5.0},
        trust={"audit_fraction": 1.0},
    )
    running: list[RunningStageServer] = []
    try:
        for stage in (1, 2):
            running.append(await start_stage_server(job, StageServerOptions(stage=stage)))
        yield job, running
    finally:
        for s in running:
            await s.stop()


def _x(job: JobConfig, seed: int) -> torch.Tensor:
    t, m = job.model, job.training
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m.microbatch_size, t.seq_len, t.d_model, generator=g, dtype=torch.float64)


def _call(job: JobConfig, x: torch.Tensor, to: str) -> WirePush:
    t, m = job.model, job.training
    targets = torch.zeros(m.microbatch_size, t.seq_len, dtype=torch.long)
    route = (pb.Route(peers=[to], addresses=[to]),)
    return PushCall(0, 0, Crossing(x), targets, route=route, need_grad_inputs=True, run=RUN)


@pytest.mark.attack("push-record")
async def test_a_second_push_of_a_run_is_turned_away_and_the_first_record_kept(
    servers: tuple[JobConfig, list[RunningStageServer]],
) -> None:
    job, (middle, last) = servers
    honest, forged = _x(job, 0), _x(job, 1)
    client = StageClient(middle.address, job, fingerprint(job), 1)
    try:
        await client.push(_call(job, honest, last.address), timeout=30)
        with pytest.raises(Busy, match=r"run 7 .* once"):
            await client.push(_call(job, forged, last.address), timeout=30)
        kept, _ = await client.record(0, 0, RUN, tensors=False)
    finally:
        await client.close()
    assert kept.inputs == digest(honest)  # before: the forged inputs' digest


async def test_a_push_that_failed_leaves_no_record_and_its_retry_makes_one(
    servers: tuple[JobConfig, list[RunningStageServer]],
) -> None:
    """The honest retry of a hop: the first try's next stage was gone, the retry of the same run
    goes on to another replica."""
    job, (middle, last) = servers
    x = _x(job, 0)
    client = StageClient(middle.address, job, fingerprint(job), 1)
    try:
        with pytest.raises(PeerUnavailable):
            await client.push(_call(job, x, "127.0.0.1:1"), timeout=30)  # nobody listens
        await client.push(_call(job, x, last.address), timeout=30)
        kept, _ = await client.record(0, 0, RUN, tensors=False)
    finally:
        await client.close()
    assert kept.inputs == digest(x)


def test_a_record_whose_backward_began_stays_when_its_push_fails() -> None:
    """A caller that hangs up once this replica's backward began does not end the backward (it
    runs on the worker): what it adds to the step is the record's. Dropped, the run could be
    pushed again with other inputs, and the record audited would not be what was added."""
    records = PushRecords("p", lambda: 8)
    failed = records.begin(1, 0, 0, RUN)
    records.drop(failed)  # failed before its backward: the retry makes its own
    records.check(0, 0, RUN)
    late = records.begin(1, 0, 0, RUN)
    late.backward_begins()
    records.drop(late)
    with pytest.raises(Busy):
        records.check(0, 0, RUN)
    assert records.get(0, 0, RUN) is late


def test_a_run_is_remembered_past_its_records_eviction() -> None:
    """Any token holder may push runs of its own until an honest run's record is evicted; the
    honest run pushed again is turned away all the same."""
    records = PushRecords("p", lambda: 2)
    records.begin(1, 0, 0, RUN)
    for run in range(100, 110):  # the records of ten runs of another's
        records.begin(1, 0, 0, run)
    with pytest.raises(ActivationsNotCached):
        records.get(0, 0, RUN)  # evicted: its audit finds no record (as before)
    with pytest.raises(Busy):
        records.check(0, 0, RUN)
