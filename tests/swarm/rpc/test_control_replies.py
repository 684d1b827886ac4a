"""A replica's answer to the coordinator's unary calls is bounded (`swarm.rpc.control_replies`):
they came on the data channel (64 MiB by default) and were parsed whole on the scheduler's event
loop, then copied and scanned. A hostile replica as a real gRPC server answers Info and Commit
with what each test gives it; the stage client refuses an answer past its counts as the
replica's `BadReply`, and one past the control channel's size before it is parsed."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from swarm.errors import BadReply, PeerUnavailable, SwarmError
from swarm.job.config import JobConfig
from swarm.proto import stage_pb2 as pb
from swarm.proto import stage_pb2_grpc
from swarm.rpc.control_replies import control_reply_bytes
from swarm.rpc.stage_client import StageClient
from tests.support.hostile import serving
from tests.support.jobs import make_job

pytestmark = pytest.mark.timeout(60)


class _Answers(stage_pb2_grpc.StageServiceServicer):
    def __init__(self, info: pb.StageInfoResponse, commit: pb.StageCommitResponse) -> None:
        self.info, self.commit = info, commit

    async def Info(  # type: ignore[override]
        self, request: pb.StageInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.StageInfoResponse:
        return self.info

    async def Commit(  # type: ignore[override]
        self, request: pb.StageCommitRequest, context: grpc.aio.ServicerContext
    ) -> pb.StageCommitResponse:
        return self.commit


def _job(tmp_path: Path) -> JobConfig:
    return make_job(tmp_path, training={"target_batch_size": 16})  # 4 microbatches a step


async def _prepare(client: StageClient, group: int, seeds: int = 0) -> pb.StageCommitResponse:
    """The stage client's PREPARE of a round of `group` members, with `seeds` audit seeds."""
    return await client.commit(
        0,
        [],
        0,
        phase=pb.COMMIT_PHASE_PREPARE,
        group=[f"127.0.0.1:{9000 + i}" for i in range(group)],
        check_seed=7,
        audit_seeds=list(range(1, seeds + 1)),
    )


async def test_an_honest_answer_passes_and_counts_past_the_job_are_the_replicas_fault(
    tmp_path: Path,
) -> None:
    job = _job(tmp_path)
    assert job.training.microbatches_per_step == 4
    checks = [pb.SumCheck(part=k, received=[1.0, 2.0]) for k in range(2)]
    honest = _Answers(
        pb.StageInfoResponse(receipts=[0, 1, 2, 3], layers=[0, 1, 2]),
        pb.StageCommitResponse(sum_checks=checks, audit_checks=checks),
    )
    async with serving(honest) as address:
        client = StageClient(address, job, "j", 0)
        try:
            assert list((await client.info()).receipts) == [0, 1, 2, 3]
            assert len((await _prepare(client, 2, seeds=1)).sum_checks) == 2
            honest.info = pb.StageInfoResponse(receipts=range(10_000))
            with pytest.raises(BadReply, match="lists 10000 receipts, past the job's 4"):
                await client.info()
            honest.info = pb.StageInfoResponse(receipts=[0], receipt_runs=range(10_000))
            with pytest.raises(BadReply, match="lists 10000 receipt_runs, past the job's 4"):
                await client.info()
            flying = [pb.PushInFlight(step=0, index=i % 4, run=i) for i in range(8)]
            honest.info = pb.StageInfoResponse(in_flight=flying)  # two steps' worth: honest
            assert len((await client.info()).in_flight) == 8
            honest.info = pb.StageInfoResponse(in_flight=flying * 1000)
            with pytest.raises(BadReply, match="lists 8000 calls in flight, past the job's 8"):
                await client.info()
            honest.commit = pb.StageCommitResponse(sum_checks=[pb.SumCheck()] * 5)
            with pytest.raises(BadReply, match="holds 5 sum checks, past the round's 2"):
                await _prepare(client, 2)
            honest.commit = pb.StageCommitResponse(sum_checks=[pb.SumCheck(received=[0.0] * 9)])
            with pytest.raises(BadReply, match="lists 9 senders, past the round's 2"):
                await _prepare(client, 2)
        finally:
            await client.close()


async def test_an_audited_round_of_many_replicas_answers_within_the_bound(tmp_path: Path) -> None:
    """160 replicas, every other one audited by each: 160 x 159 audit checks, 1.25 MB (past the
    1 MiB the control channel first took)."""
    job, group = _job(tmp_path), 160
    check = pb.SumCheck(part=1, dot=1.5, magnitude=2.5, sum_dot=3.5, unit=2**-53, norm=4.5)
    answer = pb.StageCommitResponse(
        sum_checks=[check] * group, audit_checks=[check] * (group * (group - 1))
    )
    assert answer.ByteSize() > 1_200_000
    async with serving(_Answers(pb.StageInfoResponse(), answer)) as address:
        client = StageClient(address, job, "j", 0)
        try:
            got = await _prepare(client, group, seeds=group - 1)
            assert len(got.audit_checks) == group * (group - 1)
        finally:
            await client.close()


async def test_an_answer_past_the_control_channels_size_is_never_parsed(tmp_path: Path) -> None:
    job = _job(tmp_path)
    huge = pb.StageInfoResponse(peer="x" * (24 << 20))  # 24 MiB: within the data channel's 64
    assert huge.ByteSize() > control_reply_bytes(job)
    async with serving(_Answers(huge, pb.StageCommitResponse())) as address:
        client = StageClient(address, job, "j", 0)
        try:
            with pytest.raises(SwarmError, match=r"RESOURCE_EXHAUSTED|larger than max"):
                await client.info()
        finally:
            await client.close()


async def test_a_closed_client_opens_no_control_channel(tmp_path: Path) -> None:
    client = StageClient("127.0.0.1:9", _job(tmp_path), "j", 0)
    await client.close()
    with pytest.raises(PeerUnavailable, match="closed before the call"):
        await client.info()
    assert client._control_channel is None  # none opened that nothing would close
