"""A follower's (a standby's, a joiner's) updates in the codec of the pool's averaging (issue 67,
item 3): what a replica keeps and sends of a step averaged in a lossy codec is the bytes every
replica decoded the pool's sum from, one message per part, so the follower gets fewer bytes than
the float values and decodes them to exactly what the pool applied. Real gRPC: the pool's
averaging (`all_reduce`, three replicas), and an Updates stream from the update log to the
client a follower copies with."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch

from stage_server.averaging.flat import unflatten
from stage_server.averaging.sent_sums import SentSum
from stage_server.replica.messages import updates_reply
from stage_server.replica.update_log import UpdateLog
from swarm.model.state_checks import StateChecks
from swarm.model.transformer import stage_layout
from swarm.proto import stage_pb2 as pb
from swarm.proto import stage_pb2_grpc
from swarm.rpc.stage_client import StageClient
from swarm.rpc.state_streams import MAX_FLAT_PARTS, FlatSum, Update
from swarm.rpc.stream_order import OutOfOrder
from swarm.wire.codec import CODEC_BF16, CODEC_FP16, CODEC_HADAMARD3, CODEC_INT8_BLOCKWISE
from tests.support.hostile import serving
from tests.support.jobs import make_job
from tests.support.pools import assert_identical, reduce_all, replicas

pytestmark = pytest.mark.timeout(120)

STAGE = 1  # of the tiny job: one transformer block
STEP = 3


class LogServer(stage_pb2_grpc.StageServiceServicer):
    """Answers Updates from `log` as a replica does (`updates_reply`), counting the tensor
    bytes it writes."""

    def __init__(self, log: UpdateLog, chunk_bytes: int) -> None:
        self.log, self.chunk_bytes, self.sent = log, chunk_bytes, 0

    async def Updates(  # type: ignore[override]
        self, request: pb.StageUpdatesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StageUpdatesResponse]:
        for part in updates_reply(self.log.since(request.follower, request.from_step), 4096):
            self.sent += len(part.chunk.data) + sum(len(t.data) for t in part.tensors)
            yield part


async def _followed(tmp_path: Path, update: Update) -> tuple[list[Update], int]:
    """`update` kept by a replica's log for a follower, and what the follower receives of it
    over Updates (checked as the stage's); the tensor bytes sent."""
    job = make_job(tmp_path)
    log = UpdateLog(1 << 30)
    log.follow("standby", STEP)
    log.record(update)
    server = LogServer(log, 4096)
    async with serving(server) as address:
        client = StageClient(address, job, "job", STAGE)
        try:
            got = await client.updates("standby", STEP, expect=StateChecks(job, STAGE))
        finally:
            await client.close()
    return got, server.sent


@pytest.mark.parametrize(
    ("codec", "at_most"),
    [(CODEC_FP16, 0.51), (CODEC_BF16, 0.51), (CODEC_INT8_BLOCKWISE, 0.27), (CODEC_HADAMARD3, 0.13)],
)
async def test_a_follower_gets_the_pools_sum_in_its_codec_and_applies_what_the_pool_did(
    tmp_path: Path, codec: int, at_most: float
) -> None:
    job = make_job(tmp_path)
    like = [p.detach() for p in stage_layout(job, STAGE).parameters()]
    numel, dtype = sum(p.numel() for p in like), like[0].dtype
    n = 3
    flats = [torch.randn(numel, dtype=dtype) for _ in range(n)]
    sent = [SentSum() for _ in range(n)]
    async with replicas(n) as pool:
        results = await reduce_all(
            pool, flats, codec=codec, block_size=256, chunk_bytes=4096, on_sum=sent
        )
    total = assert_identical(results)  # what every replica of the pool applies
    carried = [s.whole(numel) for s in sent]
    assert all(len(c) == n for c in carried)
    # Each replica's is the same bytes: an owner's own part as it encoded it, the others'
    # as they came.
    assert all(
        [m.SerializeToString() for m in c] == [m.SerializeToString() for m in carried[0]]
        for c in carried[1:]
    )
    for index in (0, 2):  # followers of an owner of the first part, and of the last
        update = Update(STEP, unflatten(total, like), 8, encoded=carried[index])
        got, nbytes = await _followed(tmp_path, update)
        assert [u.step for u in got] == [STEP] and got[0].total_samples == 8
        applied = got[0].grad_sums
        assert len(applied) == len(like)
        assert all(
            torch.equal(g, t) and g.dtype == t.dtype and g.shape == t.shape
            for g, t in zip(applied, unflatten(total, like), strict=True)
        )
        values = numel * total.element_size()
        assert nbytes <= at_most * values, (nbytes, values)


async def test_an_update_no_codec_carried_goes_as_its_values(tmp_path: Path) -> None:
    # A pool of one averages nothing, and a codec of none carries the values: its followers get
    # the sums as the replica applied them, one message a parameter.
    job = make_job(tmp_path)
    like = [torch.randn(p.shape, dtype=p.dtype) for p in stage_layout(job, STAGE).parameters()]
    got, nbytes = await _followed(tmp_path, Update(STEP, like, 8))
    assert all(torch.equal(g, t) for g, t in zip(got[0].grad_sums, like, strict=True))
    assert nbytes == sum(t.nbytes for t in like)


def test_a_flat_sum_is_refused_where_its_parts_are_not_the_stages_values() -> None:
    shapes = [torch.Size([2, 3]), torch.Size([4])]  # 10 values
    flat = FlatSum(shapes)
    assert flat.add("flat/0", torch.zeros(6), 0) == []
    with pytest.raises(OutOfOrder, match="'flat/2'"):
        flat.add("flat/2", torch.zeros(2), 0)  # flat/1 is due
    with pytest.raises(OutOfOrder, match="more than the stage's 10 values"):
        flat.add("flat/1", torch.zeros(5), 0)
    with pytest.raises(OutOfOrder, match="float64"):
        flat.add("flat/1", torch.zeros(4, dtype=torch.float64), 0)  # another dtype than flat/0
    with pytest.raises(OutOfOrder, match="gradient sum '0' in a flat sum"):
        flat.add("0", torch.zeros(2, 3), 0)
    cut = flat.add("flat/1", torch.arange(4.0), 0)
    assert [(name, list(t.shape)) for name, t in cut] == [("0", [2, 3]), ("1", [4])]
    assert torch.equal(cut[1][1], torch.arange(4.0))
    with pytest.raises(OutOfOrder, match="'flat/0'"):
        FlatSum(shapes).add("flat/0", torch.zeros(4), 1)  # after a sum of its own: not one
    many = FlatSum([torch.Size([MAX_FLAT_PARTS + 1])])
    for j in range(MAX_FLAT_PARTS):
        many.add(f"flat/{j}", torch.zeros(1), 0)
    with pytest.raises(OutOfOrder, match=f"{MAX_FLAT_PARTS} parts"):
        many.add(f"flat/{MAX_FLAT_PARTS}", torch.zeros(1), 0)
