"""A live stage server (real gRPC on a free port) refuses bad requests with the right status code
and keeps serving."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stage_server.server import RunningStageServer, StageServerOptions, start_stage_server
from swarm.errors import ActivationsNotCached, InvalidArgument
from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.proto import stage_pb2 as pb
from swarm.proto import stage_pb2_grpc, tensor_pb2
from swarm.rpc.stage_client import StageClient, as_tensor
from swarm.wire import chunking as wire
from swarm.wire import codec
from swarm.wire.crossing import Crossing
from tests.support.jobs import make_job

MiB = 1 << 20


@pytest.fixture
def job(tmp_path: Path) -> JobConfig:
    return make_job(
        tmp_path,
        training={"stages": 3},
        runtime={
            "max_tensor_bytes": MiB,
            "chunk_bytes": 64 * 1024,
            "max_message_bytes": 256 * 1024,
        },
    )


@pytest.fixture
async def server(job: JobConfig) -> AsyncIterator[RunningStageServer]:
    running = await start_stage_server(job, StageServerOptions(stage=1, metrics_port=0))
    yield running
    await running.stop()


@pytest.fixture
async def stub(server: RunningStageServer) -> AsyncIterator[stage_pb2_grpc.StageServiceStub]:
    big = [
        ("grpc.max_send_message_length", 64 * MiB),
        ("grpc.max_receive_message_length", 64 * MiB),
    ]
    async with grpc.aio.insecure_channel(server.address, options=big) as channel:
        yield stage_pb2_grpc.StageServiceStub(channel)


def _hidden(
    batch: int = 4, seq: int = 16, width: int = 32, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    return torch.randn(batch, seq, width, dtype=dtype)


def _forward(
    job: JobConfig,
    *tensors: tensor_pb2.Tensor,
    step: int = 0,
    stage: int = 1,
    job_id: str | None = None,
    reply_codec: int = 0,
) -> pb.StageForwardRequest:
    return pb.StageForwardRequest(
        job=fingerprint(job) if job_id is None else job_id,
        stage=stage,
        microbatch=pb.MicrobatchId(step=step, index=0),
        tensors=list(tensors),
        reply_codec=reply_codec,
    )


async def _call(method: Any, *messages: Any) -> list[Any]:
    call = method(timeout=30)
    for m in messages:
        await call.write(m)
    await call.done_writing()
    return [r async for r in call]


async def _status(method: Any, *messages: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _call(method, *messages)
    return info.value.code()


async def test_good_forward_then_bad_requests_then_still_serving(
    job: JobConfig, server: RunningStageServer, stub: stage_pb2_grpc.StageServiceStub
) -> None:
    good = codec.encode(_hidden(), "inputs")
    (reply,) = await _call(stub.Forward, _forward(job, good))
    out = codec.decode(reply.tensors[0])
    assert out.shape == (4, 16, 32) and out.dtype == torch.float64

    cases: list[tuple[Any, list[Any], grpc.StatusCode]] = [
        (stub.Forward, [_forward(job, good, job_id="nope")], grpc.StatusCode.NOT_FOUND),
        (stub.Forward, [_forward(job, good, stage=0)], grpc.StatusCode.NOT_FOUND),
        (
            stub.Forward,
            [_forward(job, codec.encode(_hidden(width=8), "inputs"))],
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            stub.Forward,
            [_forward(job, codec.encode(_hidden(dtype=torch.float32), "inputs"))],
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            stub.Forward,
            [_forward(job, codec.encode(_hidden(), "wrong_name"))],
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            stub.Forward,
            [
                _forward(
                    job,
                    tensor_pb2.Tensor(
                        name="inputs",
                        dtype="float64",
                        shape=[4, 16, 32],
                        data=b"\0" * 10,
                        nbytes=10,
                    ),
                )
            ],
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            stub.Forward,
            [
                _forward(
                    job,
                    tensor_pb2.Tensor(
                        name="inputs", dtype="complex999", shape=[1], data=b"\0" * 8, nbytes=8
                    ),
                )
            ],
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (stub.Forward, [_forward(job, good, reply_codec=42)], grpc.StatusCode.INVALID_ARGUMENT),
        (stub.Forward, [_forward(job, good, step=7)], grpc.StatusCode.FAILED_PRECONDITION),
        # declared larger than max_tensor_bytes: refused before anything is allocated
        (
            stub.Forward,
            [
                _forward(
                    job,
                    tensor_pb2.Tensor(
                        name="inputs", dtype="float64", shape=[4096, 16, 32], nbytes=16 * MiB
                    ),
                )
            ],
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ),
        # one message above the server's max_message_bytes
        (
            stub.Forward,
            [_forward(job, codec.encode(_hidden(batch=64), "inputs"))],
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ),
        (
            stub.Backward,
            [pb.StageBackwardRequest(job=fingerprint(job), stage=1, tensors=[good])],
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (stub.Forward, [], grpc.StatusCode.INVALID_ARGUMENT),
    ]
    for method, messages, expected in cases:
        assert await _status(method, *messages) == expected, messages[:1]

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Commit(
            pb.StageCommitRequest(
                job=fingerprint(job), stage=1, step=0, microbatches=[0], total_samples=4
            ),
            timeout=10,
        )
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "missing" in (info.value.details() or "")

    # still serving, and the metrics saw it all
    (reply,) = await _call(stub.Forward, _forward(job, good))
    assert torch.equal(codec.decode(reply.tensors[0]), out)
    text = (
        urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10)
        .read()
        .decode()
    )
    assert 'method="Forward"' in text and 'code="RESOURCE_EXHAUSTED"' in text
    assert 'code="NOT_FOUND"' in text and "swarm_stage_request_seconds_bucket" in text


async def test_chunked_activations_pass_and_health_says_serving(
    job: JobConfig, server: RunningStageServer
) -> None:
    # 4 x 16 x 32 float64 is 128 KiB: above chunk_bytes (64 KiB), so it streams in chunks.
    client = StageClient(server.address, job, fingerprint(job), 1)
    try:
        x = _hidden()
        out = as_tensor(await client.forward(0, 0, Crossing(x)))
        grad = await client.backward(0, 0, None, torch.ones_like(out))  # uses the cached forward
        assert grad.grad_inputs is not None and as_tensor(grad.grad_inputs).shape == x.shape
        assert grad.receipt.samples == 4 and not grad.receipt.duplicate
        info = await client.info()
        assert (info.stage, info.num_stages, info.pending_microbatches) == (1, 3, 1)
        response = await client.commit(0, [0], 4)
        assert response.step == 1 and not response.already_committed
        assert (await client.commit(0, [0], 4)).already_committed
        step, state = await client.download_state(expect=server.runtime.checks.state)
        assert step == 1 and set(state) == set(server.runtime.state_dict())
        health = health_pb2_grpc.HealthStub(client.channel)
        status = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert status.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await client.close()


async def test_prepare_answers_its_norm_and_the_clipping_coefficient_reaches_its_followers(
    job: JobConfig, server: RunningStageServer
) -> None:
    client = StageClient(server.address, job, fingerprint(job), 1)
    try:
        out = as_tensor(await client.forward(0, 0, Crossing(_hidden())))
        await client.backward(0, 0, None, torch.ones_like(out))
        server.runtime.updates.follow("f", 0)  # a copy of step 0 follows this replica
        prepared = await client.commit(0, [0], 4, phase=pb.COMMIT_PHASE_PREPARE)
        assert prepared.grad_sq_norm == server.runtime.prepared_sq_norm(0) > 0
        with pytest.raises(InvalidArgument, match="grad_scale"):
            await client.commit(0, [], 0, phase=pb.COMMIT_PHASE_APPLY, grad_scale=1.5)
        await client.commit(0, [], 0, phase=pb.COMMIT_PHASE_APPLY, grad_scale=0.25)
        info = await client.info()
        assert (info.step, info.applied_step, info.applied_scale) == (1, 0, 0.25)
        (update,) = await client.updates("f", 0, expect=server.runtime.checks.state)
        assert (update.step, update.total_samples, update.scale) == (0, 4, 0.25)
        assert len(update.grad_sums) == len(server.runtime.params)
    finally:
        await client.close()


async def test_backward_without_inputs_needs_the_cached_forward(
    job: JobConfig, server: RunningStageServer
) -> None:
    client = StageClient(server.address, job, fingerprint(job), 1)
    try:
        x = _hidden()
        with pytest.raises(ActivationsNotCached) as info:  # no forward here: nothing cached
            await client.backward(0, 3, None, torch.ones_like(x))
        cause = info.value.__cause__  # the client converted the status at its boundary
        assert isinstance(cause, grpc.aio.AioRpcError)
        assert cause.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert ActivationsNotCached.PREFIX in str(info.value)
        # with the inputs, the replica recomputes; the same gradient as from the cache
        recomputed = await client.backward(0, 3, Crossing(x), torch.ones_like(x), accumulate=False)
        await client.forward(0, 4, Crossing(x))
        cached = await client.backward(0, 4, None, torch.ones_like(x), accumulate=False)
        assert recomputed.grad_inputs is not None and cached.grad_inputs is not None
        assert torch.equal(as_tensor(recomputed.grad_inputs), as_tensor(cached.grad_inputs))
    finally:
        await client.close()


async def test_a_batch_above_microbatch_size_is_refused_before_the_compute(
    job: JobConfig, server: RunningStageServer, stub: stage_pb2_grpc.StageServiceStub
) -> None:
    # One sample more than the job's microbatch_size (4): small bytes, but a batch this size (or
    # a thousand times it) would take activations in proportion.
    big = codec.encode(_hidden(batch=job.training.microbatch_size + 1), "inputs")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _call(stub.Forward, _forward(job, big))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "microbatch_size" in (info.value.details() or "")
    backward = pb.StageBackwardRequest(
        job=fingerprint(job),
        stage=1,
        tensors=[big, codec.encode(_hidden(batch=5), "grad_outputs")],
    )
    assert await _status(stub.Backward, backward) in (
        grpc.StatusCode.INVALID_ARGUMENT,  # the batch
        grpc.StatusCode.RESOURCE_EXHAUSTED,  # or the bytes of two tensors of that batch
    )
    # Declared (not sent) bytes that only an oversized batch needs, though under
    # max_tensor_bytes: refused from the header, before a buffer is allocated for them.
    declared = tensor_pb2.Tensor(
        name="inputs", dtype="float64", shape=[128, 16, 32], nbytes=128 * 16 * 32 * 8
    )
    assert declared.nbytes < job.runtime.max_tensor_bytes
    assert await _status(stub.Forward, _forward(job, declared)) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    (reply,) = await _call(stub.Forward, _forward(job, codec.encode(_hidden(), "inputs")))
    assert codec.decode(reply.tensors[0]).shape == (4, 16, 32)  # still serving


async def _load_call(stub: stage_pb2_grpc.StageServiceStub, messages: list[Any]) -> Any:
    call = stub.LoadState(timeout=30)
    for message in messages:
        await call.write(message)
    await call.done_writing()
    return await call


async def _load_status(stub: stage_pb2_grpc.StageServiceStub, messages: list[Any]) -> Any:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _load_call(stub, messages)
    return info.value.code()


def _load(job: JobConfig, tensors: dict[str, torch.Tensor], step: int = 0) -> list[Any]:
    """LoadState's messages, as `StageClient.load_state` streams them: one tensor each, chunked."""
    return [
        part
        for k, v in tensors.items()
        for part in wire.split(
            pb.StageLoadStateRequest(
                job=fingerprint(job), stage=1, step=step, tensors=[codec.encode(v, k)]
            ),
            job.runtime.chunk_bytes,
        )
    ]


async def test_load_state_accepts_only_the_stages_state(
    job: JobConfig, server: RunningStageServer, stub: stage_pb2_grpc.StageServiceStub
) -> None:
    # A refusal ends the call; a client still writing then sees its own INTERNAL error rather
    # than the server's status, so each refused message here is the call's last.
    own = server.runtime.export_state()
    params = [k for k in own if k.startswith("param/")]
    # Small messages (unchunked), each fine alone, but together above what the stage's state can
    # take: refused once the total passes it, not accepted until memory runs out.
    sizes = [p.numel() for p in server.runtime.params]
    index, piece = max(enumerate(sizes), key=lambda item: item[1])  # 4096 values: 32 KiB
    room = server.runtime.max_state_bytes() - sum(t.nbytes for t in own.values())
    count = room // (piece * 8) + 1
    # (One of the optimizer's own keys, sent again and again: an unknown key is refused at once.)
    shape = server.runtime.params[index].shape  # its parameter's: each one passes alone
    junk = _load(job, {f"optim/{index}/exp_avg": torch.zeros(shape, dtype=torch.float64)})
    assert count * piece * 8 > 10 * sum(t.nbytes for t in own.values())
    assert await _load_status(stub, _load(job, own) + junk * count) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    # Names and shapes must be the stage's own.
    first = own[params[0]]
    for name, bad in (
        ("param/layers.9.weight", torch.zeros(3)),
        (params[0], torch.zeros(*first.shape, 2, dtype=first.dtype)),
        ("optim/999/exp_avg", torch.zeros(3)),
        ("optim/0/exp_avg", torch.zeros(first.numel() + 1)),
        ("other/thing", torch.zeros(3)),
    ):
        rest = {k: v for k, v in own.items() if k != name}
        status = await _load_status(stub, _load(job, {**rest, name: bad}))
        assert status == grpc.StatusCode.INVALID_ARGUMENT, name
    # The stage's own state still loads.
    assert (await _load_call(stub, _load(job, own, step=0))).step == 0


async def test_each_direction_travels_with_its_own_codec(
    job: JobConfig, server: RunningStageServer, tmp_path: Path
) -> None:
    # The server serves `job`; the client's job differs in the codecs only (set per direction).
    directed = make_job(
        tmp_path,
        name="directed",
        training={"stages": 3},
        compression={"wire": "none", "forward": "hadamard3", "backward": "fp16"},
    )
    client = StageClient(server.address, directed, fingerprint(job), 1)
    try:
        x = _hidden()
        out = await client.forward(0, 0, Crossing(x))
        assert isinstance(out, tensor_pb2.Tensor) and out.codec == codec.CODEC_HADAMARD3
        result = await client.backward(0, 0, Crossing(x), torch.ones_like(as_tensor(out)))
        grad = result.grad_inputs
        assert isinstance(grad, tensor_pb2.Tensor) and grad.codec == codec.CODEC_FP16
        assert as_tensor(grad).shape == x.shape
    finally:
        await client.close()


async def test_a_data_plane_call_leaves_no_chunk_of_its_request_held(
    tmp_path: Path,
) -> None:
    """The stage server reads a request's stream to its end (the caller closed its side before
    it waits): gRPC lets go of the request's last chunk as the call ends. Before, every Forward
    or Backward left it held until the garbage collector found the call (off here, so that a
    reference cycle shows): a chunk of up to `runtime.chunk_bytes` a call."""
    chunk = 64 << 10  # a request of 512 KiB comes in 8 chunks
    job = make_job(
        tmp_path,
        model={"d_model": 256, "seq_len": 64},
        training={"stages": 3},
        runtime={"chunk_bytes": chunk},
    )
    running = await start_stage_server(job, StageServerOptions(stage=1))
    client = StageClient(running.address, job, fingerprint(job), 1)
    x = torch.randn(4, job.model.seq_len, job.model.d_model, dtype=torch.float64)
    try:
        await client.forward(0, 0, Crossing(x))  # warm
        gc.collect()
        gc.disable()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for index in range(1, 9):
                await client.forward(0, index, Crossing(x))
            await asyncio.sleep(0.1)
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
            gc.enable()
    finally:
        await client.close()
        await running.stop()
    assert held < 2 * chunk, f"{held} bytes held after 8 calls"


async def test_a_prepare_that_names_audits_keeps_its_steps_parameters_for_them(
    job: JobConfig, server: RunningStageServer
) -> None:
    """A replica that recorded no push of step 0 (routing left it out) but whose PREPARE names
    audits of others' contributions to it (`audit_seeds`: it is one of their auditors) keeps
    step 0's parameters past the update: those audits' re-executions may come after it
    (`stage_server.replica.prior_params`). Before, it kept none and refused them as stale, and
    every contribution it audited went unjudged (docs/decisions.md, "A late audit ends before
    the next step commits")."""
    client = StageClient(server.address, job, fingerprint(job), 1)
    try:
        out = as_tensor(await client.forward(0, 0, Crossing(_hidden())))
        await client.backward(0, 0, None, torch.ones_like(out))  # no push: nothing recorded
        phase = pb.COMMIT_PHASE_PREPARE
        await client.commit(0, [0], 4, phase=phase, check_seed=3, audit_seeds=[5])
        await client.commit(0, [], 0, phase=pb.COMMIT_PHASE_APPLY)
        assert server.runtime.step == 1
        assert server.runtime.copies.step == 0  # kept for step 0's late re-executions
    finally:
        await client.close()
