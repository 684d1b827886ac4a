"""A request's lossy tensors are widened off the stage server's event loop where that is work:
hadamard3's inverse rotation took 98-174 ms for one microbatch of 4M values, and every other
call of the server (a neighbour's push, a health check, the next microbatch's header) waited
on the loop meanwhile. A tensor sent as it is (shared with its message, no work) and a small
lossy one are decoded in place: a thread's hop would cost more than they do. Real stage servers
on real ports, in this process: each decode is seen with the thread it ran on."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from stage_server.server import StageServerOptions, start_stage_server
from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.proto import stage_pb2 as pb
from swarm.proto import stage_pb2_grpc
from swarm.rpc.push_call import PushCall
from swarm.rpc.stage_client import StageClient
from swarm.wire import chunking, codec
from swarm.wire.crossing import Crossing
from tests.support.jobs import make_job

pytestmark = pytest.mark.timeout(120)

SHAPE = (8, 128, 64)  # one microbatch's boundary: 65,536 values, 2^20 of hadamard3's work


def _job(tmp_path: Path, **more: dict[str, Any]) -> JobConfig:
    return make_job(
        tmp_path,
        model={"d_model": SHAPE[2], "seq_len": SHAPE[1]},
        training={"stages": 3, "microbatch_size": SHAPE[0], "target_batch_size": SHAPE[0]},
        **more,
    )


@pytest.fixture
def decoded_on(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, list[str]]]:
    """Every tensor decoded meanwhile: the thread it was decoded on, by "lossy" or "none"."""
    seen: dict[str, list[str]] = {}
    decode = codec.decode

    def recording(msg: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        way = "none" if msg.codec == codec.CODEC_NONE else "lossy"
        seen.setdefault(way, []).append(threading.current_thread().name)
        return decode(msg, *args, **kwargs)

    monkeypatch.setattr(chunking, "decode", recording)
    monkeypatch.setattr(codec, "decode", recording)
    yield seen


async def test_a_large_hadamard_body_is_decoded_off_the_event_loop(
    tmp_path: Path, decoded_on: dict[str, list[str]]
) -> None:
    job = _job(tmp_path)
    running = await start_stage_server(job, StageServerOptions(stage=1))
    loop_thread = threading.current_thread().name
    x = torch.randn(*SHAPE, dtype=torch.float64)
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            stub = stage_pb2_grpc.StageServiceStub(channel)
            for index, way in enumerate(("hadamard3", "none")):
                request = pb.StageForwardRequest(
                    job=fingerprint(job),
                    stage=1,
                    microbatch=pb.MicrobatchId(step=0, index=index),
                    tensors=[codec.encode(x, "inputs", codec.CODECS[way])],
                )
                call = stub.Forward(timeout=60)
                await call.write(request)
                await call.done_writing()
                (reply,) = [m async for m in call]
                assert reply.tensors[0].shape == list(SHAPE)
    finally:
        await running.stop()
    lossy, plain = decoded_on.get("lossy", []), decoded_on.get("none", [])
    assert lossy and loop_thread not in lossy, decoded_on
    assert plain and set(plain) == {loop_thread}, decoded_on


async def test_a_pushed_gradient_that_came_back_lossy_is_decoded_off_the_event_loop(
    tmp_path: Path, decoded_on: dict[str, list[str]]
) -> None:
    """On the push plane stage 1 pushes its outputs on to stage 2 and decodes the gradient of
    them that comes back (`[compression] wire = "hadamard3"`: both ways lossy)."""
    job = _job(tmp_path, runtime={"data_plane": "push"}, compression={"wire": "hadamard3"})
    running = [await start_stage_server(job, StageServerOptions(stage=k)) for k in (1, 2)]
    loop_thread = threading.current_thread().name
    x = torch.randn(*SHAPE, dtype=torch.float64)
    inputs = codec.encode(x, "inputs", codec.CODECS["hadamard3"])
    targets = torch.randint(0, job.model.vocab_size, SHAPE[:2])
    client = StageClient(running[0].address, job, fingerprint(job), 1)
    try:
        last = running[1].address
        route = (pb.Route(peers=[last], addresses=[last]),)
        call = PushCall(0, 0, Crossing(inputs), targets, route=route, need_grad_inputs=True)
        await client.push(call, timeout=60)
    finally:
        await client.close()
        for server in running:
            await server.stop()
    lossy = decoded_on.get("lossy", [])
    # stage 1's inputs, stage 2's inputs (stage 1's outputs) and the gradient back at stage 1
    assert len(lossy) >= 3 and loop_thread not in lossy, decoded_on


async def test_a_lossy_rounds_parts_and_sums_are_decoded_off_the_event_loop(
    decoded_on: dict[str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool's round under hadamard3 (`[compression] averaging`): each owner's part as it came
    (the Reduce's body), and each sum an owner answers. A hostile owner's answer is the
    attacker's to size: its header is checked before a value of it is decoded."""
    from stage_server.averaging import butterfly
    from tests.support.pools import reduce_all, replicas

    monkeypatch.setattr(butterfly, "decode", chunking.decode)  # seen as the others are
    gen = torch.Generator().manual_seed(5)
    flats = [torch.randn(1 << 18, generator=gen) for _ in range(2)]
    loop_thread = threading.current_thread().name
    async with replicas(2) as pool:
        results = await reduce_all(pool, flats, codec=codec.CODECS["hadamard3"], timeout_s=60.0)
    assert not [r for r in results if isinstance(r, BaseException)], results
    lossy = decoded_on.get("lossy", [])
    assert len(lossy) >= 4 and loop_thread not in lossy, decoded_on
