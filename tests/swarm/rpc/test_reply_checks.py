"""A replica's answer is taken by the stage client only as the one asked for: the tensor asked
for there, of the call's shape; one not asked for dropped unread; one that does not decode
refused. Each failure is a `BadReply` (the replica's own fault: its hop backs it off, perhaps
after it accumulated), where before a Forward without its outputs raised a `KeyError` that
ended the trainer, outputs of another shape went on to the next stage, whose honest replica was
blamed, and an unasked gradient was decoded all the same. A hostile replica as a real gRPC
server, the trainer's stage client."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from swarm.clock import MonotonicClock
from swarm.errors import BadReply, RemoteError
from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.policy.wiring import Wiring
from swarm.proto import stage_pb2 as pb
from swarm.proto import stage_pb2_grpc, tensor_pb2
from swarm.rpc.hop import hop, may_have_landed
from swarm.rpc.lease import Replica
from swarm.rpc.routes import Routes
from swarm.rpc.stage_client import StageClient
from swarm.wire import chunking as wire
from swarm.wire import codec
from swarm.wire.crossing import Crossing
from tests.support.hostile import serving
from tests.support.jobs import make_job

pytestmark = pytest.mark.timeout(60)

STAGE = 1  # a middle stage of three: hidden states in, hidden states out
Tensors = Callable[[], list[tensor_pb2.Tensor]]


class Answers(stage_pb2_grpc.StageServiceServicer):
    """Answers every Forward and Backward with `tensors()`, whatever was asked."""

    def __init__(self, tensors: Tensors) -> None:
        self.tensors = tensors

    async def _read(self, requests: AsyncIterator[Any]) -> None:
        async for _ in requests:
            pass

    async def Forward(self, request_iterator: Any, context: Any) -> Any:  # type: ignore[override]
        await self._read(request_iterator)
        for part in wire.split(pb.StageForwardResponse(tensors=self.tensors()), 1 << 20):
            yield part

    async def Backward(self, request_iterator: Any, context: Any) -> Any:  # type: ignore[override]
        await self._read(request_iterator)
        receipt = pb.Receipt(stage=STAGE, samples=4)
        reply = pb.StageBackwardResponse(tensors=self.tensors(), receipt=receipt)
        for part in wire.split(reply, 1 << 20):
            yield part


@pytest.fixture
def job(tmp_path: Path) -> JobConfig:
    return make_job(tmp_path, training={"stages": 3})


def _hidden(job: JobConfig, batch: int = 4) -> torch.Tensor:
    return torch.zeros(batch, job.model.seq_len, job.model.d_model, dtype=torch.float64)


async def _forward(job: JobConfig, tensors: Tensors) -> tensor_pb2.Tensor:
    async with serving(Answers(tensors)) as address:
        client = StageClient(address, job, fingerprint(job), STAGE)
        try:
            return await client.forward(0, 0, Crossing(_hidden(job)))
        finally:
            await client.close()


async def test_a_forward_answer_is_its_outputs_of_the_microbatchs_shape(job: JobConfig) -> None:
    outputs = await _forward(job, lambda: [codec.encode(_hidden(job), "outputs")])
    assert list(outputs.shape) == list(_hidden(job).shape)


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        ("none", "holds no 'outputs'"),
        ("another name", "holds no 'outputs'"),
        ("another batch", r"is \[1, "),
        ("another width", r"is \[4, "),
        ("no dtype", "does not decode"),
        ("too few bytes", "holds 4 bytes; its header says"),
    ],
)
async def test_a_forward_answer_that_is_not_its_outputs_is_the_replicas_fault(
    job: JobConfig, answer: str, says: str
) -> None:
    def tensors() -> list[tensor_pb2.Tensor]:
        if answer == "none":
            return []
        if answer == "another name":
            return [codec.encode(_hidden(job), "x")]
        if answer == "another batch":
            return [codec.encode(_hidden(job, batch=1), "outputs")]
        if answer == "another width":
            return [codec.encode(torch.zeros(4, job.model.seq_len, 3), "outputs")]
        bad = codec.encode(_hidden(job), "outputs")
        if answer == "too few bytes":  # the right header, the wrong payload
            bad.data, bad.nbytes = b"\0" * 4, 4
            return [bad]
        bad.dtype = "no-such-dtype"
        return [bad]

    with pytest.raises(BadReply, match=says) as refused:
        await _forward(job, tensors)
    # the replica's own fault, perhaps after it accumulated: backed off, not taken at its word
    assert isinstance(refused.value, RemoteError) and may_have_landed(refused.value)


async def test_a_gradient_not_asked_for_is_dropped_unread_and_one_asked_for_checked(
    job: JobConfig,
) -> None:
    grad = _hidden(job)
    async with serving(Answers(lambda: [codec.encode(torch.zeros(7), "grad_inputs")])) as a:
        client = StageClient(a, job, fingerprint(job), STAGE)
        try:
            done = await client.backward(0, 0, Crossing(grad), grad, need_grad_inputs=False)
            assert done.grad_inputs is None  # there all the same: not taken
            with pytest.raises(BadReply, match=r"'grad_inputs' is \[7\]"):
                await client.backward(0, 0, Crossing(grad), grad, need_grad_inputs=True)
        finally:
            await client.close()
    async with serving(Answers(lambda: [codec.encode(grad, "grad_inputs")])) as address:
        client = StageClient(address, job, fingerprint(job), STAGE)
        try:
            done = await client.backward(0, 0, None, grad, need_grad_inputs=True)  # cached there
            assert done.grad_inputs is not None and list(done.grad_inputs.shape) == list(grad.shape)
        finally:
            await client.close()


@pytest.mark.parametrize("claimed", [float("nan"), -5.0, 3600.0])
async def test_a_replicas_word_for_its_wait_is_held_within_the_calls_time(
    job: JobConfig, claimed: float
) -> None:
    # A review's repro: the service time a hop measures is its call's time less the wait the
    # replica says it had; a NaN (or a week) made a slow replica measure a millionth of a
    # second, the fastest of its stage, chosen for every hop after.
    wiring = Wiring(job.training.stages, clock=MonotonicClock(), rng=random.Random(0))
    routes = Routes(job, fingerprint(job), None, wiring)
    routes.follow(STAGE, [Replica("liar", "fake:liar", 1.0), Replica("honest", "fake:honest", 1.0)])

    def answers(delay_s: float, queued: float) -> Callable[[Any, bool], Awaitable[Any]]:
        async def call(client: Any, accumulate: bool) -> Any:
            await asyncio.sleep(delay_s)
            return SimpleNamespace(queued_seconds=queued)

        return call

    try:
        await hop(routes, STAGE, answers(0.2, claimed), attempts=1, prefer="liar")
        await hop(routes, STAGE, answers(0.02, 0.0), attempts=1, prefer="honest")
        pool = wiring[STAGE]
        assert pool.throughput("honest") > pool.throughput("liar"), (
            pool.throughput("honest"),
            pool.throughput("liar"),
        )
    finally:
        await routes.close()
