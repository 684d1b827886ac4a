"""The commit protocol is the scheduler's (M9): a replica a scheduler placed takes `Commit`,
`Discard`, `Join` and `LoadState` only signed with the key the scheduler announced the job with.
Whoever else can reach the replica (any token holder) is refused: unsigned, UNAUTHENTICATED;
signed with another key, for another replica, or a signed call played again, PERMISSION_DENIED.
The scheduler's own calls go on: the job trains through the attack."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch

from swarm.errors import RemoteError
from swarm.job.config import parse_job
from swarm.net.commit_auth import SchedulerKey, SignedStub
from swarm.proto import pool_pb2, pool_pb2_grpc
from swarm.proto import stage_pb2 as pb
from swarm.rpc.stage_client import StageClient
from swarm.wire import chunking as wire
from tests.support.scheduled import AMQTT_LEAKS, LONG_SPEC, WAIT_S, scheduled_swarm
from tests.support.waiting import wait_until

pytestmark = [
    pytest.mark.attack("M9"),
    pytest.mark.slow,
    pytest.mark.timeout(240),
    AMQTT_LEAKS,
]


async def _refused(client: StageClient, step: int) -> set[str]:
    """The codes each commit-protocol call from `client` is refused with (a call taken: "OK")."""
    calls = [
        lambda: client.commit(step, [], 0, phase=pb.COMMIT_PHASE_APPLY, grad_scale=1000.0),
        lambda: client.commit(
            step, [0], 4, phase=pb.COMMIT_PHASE_PREPARE, group=["127.0.0.1:9"], round="evil"
        ),
        lambda: client.discard(step),
        lambda: client.join("127.0.0.1:9", step),
        lambda: client.load_state(step, {"param/x": torch.zeros(1)}),
    ]
    codes = set()
    for call in calls:
        try:
            await call()
            codes.add("OK")
        except RemoteError as e:
            codes.add(e.code)
        except Exception as e:  # taken, then refused for its values: the protocol was open
            codes.add(f"taken: {type(e).__name__}")
    return codes


async def _reduce_code(address: str, job_id: str, stage: int, step: int) -> grpc.StatusCode:
    """What a token holder's `Reduce` as sender 0 of the stage's next round is answered."""
    header = pool_pb2.PoolReduceRequest(
        job=job_id, stage=stage, round=f"{step + 1}/0", part=1, sender=0, group_size=2
    )
    async with grpc.aio.insecure_channel(address) as channel:
        call = pool_pb2_grpc.PoolServiceStub(channel).Reduce(timeout=10)
        for m in wire.split_tensor(header, "part", torch.zeros(4), 1 << 20):
            await call.write(m)
        await call.done_writing()
        try:
            await wire.receive_reply(call, max_bytes=1 << 20)
        except grpc.aio.AioRpcError as e:
            return e.code()
    return grpc.StatusCode.OK


async def test_only_the_scheduler_speaks_the_commit_protocol(tmp_path: Path) -> None:
    async with scheduled_swarm(tmp_path) as swarm:
        job_id = await swarm.start_job(LONG_SPEC, tmp_path)
        job = parse_job(LONG_SPEC, tmp_path, "test", check_data=False)
        registry = swarm.scheduler.peer_registry
        a = registry.peers["a"]
        address, stage, step = a.address, a.stage, swarm.step(job_id)

        # A token holder: nothing signed.
        stranger = StageClient(address, job, job_id, stage)
        # One with a key of its own (a scheduler of its own making).
        forger = StageClient(address, job, job_id, stage)
        forger.stub = SignedStub(forger.stub, SchedulerKey.generate().signer("a"), job_id, stage)
        # A hostile replica b replaying, to a, a call the scheduler signed for b.
        replayer = StageClient(address, job, job_id, stage)
        for_b = swarm.scheduler.signing.signer("b")
        replayer.stub = SignedStub(replayer.stub, for_b, job_id, stage)
        try:
            assert await _refused(stranger, step) == {"UNAUTHENTICATED"}
            assert await _refused(forger, step) == {"PERMISSION_DENIED"}
            assert await _refused(replayer, step) == {"PERMISSION_DENIED"}
            # Only a round's members reduce (`swarm.net.round_tickets`): the stranger's part as
            # a member of the next round is refused; the members' own rounds go on (below).
            denied = grpc.StatusCode.PERMISSION_DENIED
            assert await _reduce_code(address, job_id, stage, step) == denied
        finally:
            for client in (stranger, forger, replayer):
                await client.close()

        # A call the scheduler signed for a, played again: taken once (refused then for its
        # step, long past: nothing is voided), refused as a replay the second time.
        signed = pb.StageDiscardRequest(job=job_id, stage=stage, step=-1)
        metadata = swarm.scheduler.signing.signer("a").metadata("Discard", signed)
        client = StageClient(address, job, job_id, stage)
        try:
            codes = []
            for _ in range(2):
                try:
                    await client.stub.Discard(signed, metadata=metadata)
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as e:
                    codes.append(e.code())  # type: ignore[attr-defined]
            assert codes == [grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED]
        finally:
            await client.close()

        # The scheduler's own calls were taken all along: the job trains on.
        await wait_until(
            lambda: swarm.step(job_id) >= step + 3, "the job trains on", timeout_s=WAIT_S
        )
