"""A push's route, which names the replicas of each later stage its receiver sends on to, is
refused (INVALID_ARGUMENT) when it could not be one, before any of it is followed: each replica
it names is a client its receiver makes on its event loop, and a token holder's route of 30,000
made 30,000 (a header of 300 KB). Real stage server, real gRPC, the push plane."""

from __future__ import annotations

import math
from pathlib import Path

import grpc
import pytest
import torch

from stage_server.replica.next_hop import NextHop
from stage_server.server import StageServerOptions, start_stage_server
from swarm.errors import InvalidArgument
from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.net import paths
from swarm.proto import stage_pb2 as pb
from swarm.proto import stage_pb2_grpc
from swarm.rpc.routes import MAX_ROUTE_MEMBERS, check_route
from swarm.wire import chunking, codec
from tests.support.jobs import make_job

pytestmark = pytest.mark.timeout(60)


def _route(members: int, peers: int | None = None) -> pb.Route:
    return pb.Route(
        peers=[f"p{i}" for i in range(members if peers is None else peers)],
        addresses=[f"127.0.0.1:{1 + i % 60000}" for i in range(members)],
    )


def _push(
    job: JobConfig, route: list[pb.Route], *, index: int = 0, accumulate: tuple[int, ...] = ()
) -> pb.StagePushRequest:
    """A push of one microbatch to stage 1 whose route names `route`."""
    inputs = torch.randn(4, job.model.seq_len, job.model.d_model, dtype=torch.float64)
    targets = torch.zeros(4, job.model.seq_len, dtype=torch.int64)
    return pb.StagePushRequest(
        job=fingerprint(job),
        stage=1,
        microbatch=pb.MicrobatchId(step=0, index=index),
        tensors=[codec.encode(inputs, "inputs"), codec.encode(targets, "targets")],
        accumulate=list(accumulate),
        route=route,
        need_grad_inputs=True,
    )


async def _refused(channel: grpc.aio.Channel, request: pb.StagePushRequest) -> grpc.aio.AioRpcError:
    """`request` sent as a push on `channel`, whose answer must be an error: that error."""
    call = stage_pb2_grpc.StageServiceStub(channel).Push(timeout=30)
    for part in chunking.split(request, 1 << 20):
        await call.write(part)
    await call.done_writing()
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call.read()
    return refused.value


@pytest.mark.parametrize(
    ("route", "says"),
    [
        ([_route(MAX_ROUTE_MEMBERS + 1)], f"names {MAX_ROUTE_MEMBERS + 1} replicas"),
        ([_route(30_000)], "names 30000 replicas"),
        ([_route(1), _route(1)], "a route of 2 stages; 1 come after this one"),
        ([_route(2, peers=1)], "do not pair"),
        ([pb.Route(peers=["p\n"], addresses=["127.0.0.1:1"])], "names no replica"),
        ([pb.Route(peers=["p"], addresses=["x" * 1100])], "names no replica"),
    ],
    ids=["past-the-bound", "thirty-thousand", "too-many-stages", "unpaired", "control", "long"],
)
async def test_a_route_no_pool_could_be_is_refused_before_it_is_followed(
    tmp_path: Path, route: list[pb.Route], says: str
) -> None:
    job = make_job(tmp_path, training={"stages": 3}, runtime={"data_plane": "push"})
    running = await start_stage_server(job, StageServerOptions(stage=1))
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            refused = await _refused(channel, _push(job, route, accumulate=(1, 2)))
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, refused
        assert says in (refused.details() or ""), refused.details()
        hop = running.servicer._push._next_hop
        assert isinstance(hop, NextHop) and len(hop.routes.clients) == 0  # nothing followed
    finally:
        await running.stop()


def test_a_standalone_swarms_relayed_ids_are_routes_members() -> None:
    # A review's repro: a standalone swarm's peer ids are its addresses, a relayed one with its
    # peer id and its relay's address (~150 characters for a cloud host's names): refused as
    # no peer id, every push through its receiver failed INVALID_ARGUMENT.
    relayed = paths.relayed_address(
        "gpu-box-1.home-lab.a-long-volunteer-name",
        "ip-10-0-12-34.eu-west-1.compute.internal:7000",
        "relay-1.eu-west-1.swarm-volunteers.example.org:7100",
    )
    assert len(relayed) > 128  # past a peer id's bound
    check_route([pb.Route(peers=[relayed], addresses=[relayed])], 1)  # no refusal


@pytest.mark.attack("route-inf")
def test_a_routes_throughput_is_a_speed() -> None:
    """A member's throughput is the sender's word: an infinite one failed the receiver's push
    as INTERNAL after its forward (`StagePool.add` raised ValueError), logged at ERROR with a
    traceback. Refused with the route now, as any member no peer could be; 0, unknown, stays."""
    peers, addresses = ["a", "b"], ["10.0.0.1:7000", "10.0.0.2:7000"]
    check_route([pb.Route(peers=peers, addresses=addresses, throughput=[0.0, 3.5])], 1)
    for bad in (math.inf, -math.inf, math.nan, -1.0):
        with pytest.raises(InvalidArgument, match="throughput"):
            check_route([pb.Route(peers=peers, addresses=addresses, throughput=[2.0, bad])], 1)


@pytest.mark.attack("route-clients")
async def test_a_route_of_a_thousand_unreachable_replicas_makes_a_client_per_try_only(
    tmp_path: Path,
) -> None:
    """A token holder's push through a real stage server, naming 1,024 replicas of the next
    stage that none is (closed ports of this host), twice, each time others: the forward runs,
    the next hop tries a few and fails, and only those few got a client (before: all 1,024 of
    each route, made on the event loop and kept a minute once replaced)."""
    job = make_job(tmp_path, training={"stages": 3}, runtime={"data_plane": "push"})
    running = await start_stage_server(job, StageServerOptions(stage=1))
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            for k in range(2):
                route = pb.Route(
                    peers=[f"p{k}-{i}" for i in range(MAX_ROUTE_MEMBERS)],
                    addresses=[
                        f"127.0.0.1:{1 + k * MAX_ROUTE_MEMBERS + i}"
                        for i in range(MAX_ROUTE_MEMBERS)
                    ],
                )
                failed = await _refused(channel, _push(job, [route], index=k))
                assert "no replica took the microbatch" in (failed.details() or ""), failed
        hop = running.servicer._push._next_hop
        assert isinstance(hop, NextHop)
        assert len(hop.routes.clients) == MAX_ROUTE_MEMBERS  # the last route, followed whole
        assert len(hop.routes.clients.made()) <= hop.attempts
        assert len(hop.routes.retiring) <= hop.attempts  # the first route's that were made
    finally:
        await running.stop()
