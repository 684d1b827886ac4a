"""A streamed message's header is measured before protobuf parses it (issue 44, N17): one that
names more tensors or values than any sender writes is refused from a walk of its bytes, not
after protobuf has built millions of objects of it."""

from __future__ import annotations

import math
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import struct_pb2

from stage_server.server import RunningStageServer, StageServerOptions, start_stage_server
from swarm.errors import InvalidArgument
from swarm.net import dial
from swarm.proto import framing, stage_pb2, tensor_pb2
from swarm.proto.framing import MAX_HEADER_VALUES, MAX_TENSORS_PER_MESSAGE, HeaderRefused
from swarm.wire.chunking import receive
from tests.support.jobs import make_job

TOKEN = "s3cret-token"
MiB = 1 << 20
FORWARD = stage_pb2.StageForwardRequest
TENSORS = FORWARD.DESCRIPTOR.fields_by_name["tensors"].number


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    return bytes([*out, value])


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field, as protobuf encodes one."""
    return _varint((number << 3) | 2) + _varint(len(payload)) + payload


def _empty_tensors(count: int) -> bytes:
    return _field(TENSORS, b"") * count


def _many_dims(count: int) -> bytes:
    """A tensor whose shape is `count` dimensions of 1 (a packed field, a byte each)."""
    return _field(TENSORS, _field(3, b"\x01" * count))


def _parse(data: bytes) -> Any:
    return framing.deserializer(FORWARD)(data)


def test_an_honest_header_is_parsed() -> None:
    msg = FORWARD(job="j", stage=1)
    for i in range(MAX_TENSORS_PER_MESSAGE):
        msg.tensors.add(name=f"t{i}", dtype="float32", shape=[2, 3, 4], data=b"x" * 24)
    assert _parse(msg.SerializeToString()) == msg


@pytest.mark.attack("N17")
def test_too_many_tensors_are_refused_before_the_parse() -> None:
    # What follows the 65th tensor is not protobuf at all: protobuf never saw it.
    data = _empty_tensors(MAX_TENSORS_PER_MESSAGE + 1) + b"\xff" * 64
    refused = _parse(data)
    assert isinstance(refused, HeaderRefused)
    assert "65 tensors, more than 64 a message (MAX_TENSORS_PER_MESSAGE)" in str(refused)
    # Thirty million: refused as more than the values a header may hold, still unparsed.
    refused = _parse(_empty_tensors(30_000_000))
    assert isinstance(refused, HeaderRefused)
    assert f"more than {MAX_HEADER_VALUES + 1} tensors" in str(refused)


@pytest.mark.attack("N17")
@pytest.mark.parametrize(
    "data",
    [
        _many_dims(MAX_HEADER_VALUES + 1),
        # A route of a stage after this one, naming too many peers (StagePushRequest.route).
        _field(7, _field(1, b"") * (MAX_HEADER_VALUES + 1)),
    ],
    ids=["dimensions", "route peers"],
)
def test_too_many_values_are_refused_before_the_parse(data: bytes) -> None:
    refused = framing.deserializer(stage_pb2.StagePushRequest)(data)
    assert isinstance(refused, HeaderRefused) and "MAX_HEADER_VALUES" in str(refused)


async def test_a_reader_gets_the_senders_invalid_argument() -> None:
    """What `receive` makes of a header the deserializer refused, or of a message gRPC could
    not read (a client's stream yields None)."""

    async def refused() -> AsyncIterator[Any]:
        yield _parse(_empty_tensors(MAX_TENSORS_PER_MESSAGE + 1))

    async def unreadable() -> AsyncIterator[Any]:
        yield None

    with pytest.raises(InvalidArgument, match="refused before it was parsed"):
        await receive(refused(), max_bytes=1 << 20)
    with pytest.raises(InvalidArgument, match="could not be read"):
        await receive(unreadable(), max_bytes=1 << 20)


def test_malformed_is_left_to_protobuf() -> None:
    from google.protobuf.message import DecodeError

    with pytest.raises(DecodeError):
        _parse(_empty_tensors(3) + b"\xff")


@pytest.fixture
async def stage_server(tmp_path: Path) -> AsyncIterator[RunningStageServer]:
    options = StageServerOptions(stage=0, token=TOKEN)
    running = await start_stage_server(make_job(tmp_path), options)
    yield running
    await running.stop()


@pytest.mark.attack("N17")
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "header",
    [
        # 63 MiB: 65 tensors, then bytes no sender writes (an unknown field).
        _empty_tensors(MAX_TENSORS_PER_MESSAGE + 1) + _field(15, bytes(63 * MiB)),
        # 8 MiB naming eight million dimensions: 64 MiB of int64 once parsed.
        _many_dims(8 * MiB),
    ],
    ids=["63 MiB of tensors", "8M dimensions"],
)
async def test_a_stage_server_refuses_a_huge_header_unparsed(
    stage_server: RunningStageServer, header: bytes
) -> None:
    """A token holder's Forward whose header is such a message: INVALID_ARGUMENT, saying it was
    refused before it was parsed."""
    async with dial.channel(stage_server.address, token=TOKEN) as channel:
        call = channel.stream_stream("/swarm.proto.StageService/Forward")(timeout=60)
        await call.write(header)
        code, details = await call.code(), await call.details()
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert "refused before it was parsed" in details


def test_the_tensor_entry_is_a_tensor() -> None:
    # The hand-made encodings above are what protobuf reads as tensors.
    msg = _parse(_empty_tensors(2) + _many_dims(3))
    assert list(msg.tensors) == [tensor_pb2.Tensor()] * 2 + [tensor_pb2.Tensor(shape=[1, 1, 1])]


def _judged(data: bytes, cls: Any, shallow: bool) -> str | None:
    """The walk's refusal of `data` as a `cls` header (None: it passes), walked in full or
    shallow (its nested messages not descended into)."""
    tensors = cls.DESCRIPTOR.fields_by_name["tensors"].number
    header = framing._Header(data, tensors, shallow)
    try:
        header.walk(0, len(data), cls.DESCRIPTOR, 0)
        header.refuse_tensors()
    except HeaderRefused as refused:
        return str(refused)
    return None


def _push_header(rng: random.Random) -> bytes:
    msg = stage_pb2.StagePushRequest(job="j" * rng.randrange(40), stage=rng.randrange(9))
    msg.microbatch.step, msg.microbatch.index = rng.randrange(1 << 20), rng.randrange(64)
    for i in range(rng.choice([0, 1, 3, MAX_TENSORS_PER_MESSAGE, MAX_TENSORS_PER_MESSAGE + 1])):
        shape = [rng.randrange(1, 300) for _ in range(rng.randrange(5))]
        msg.tensors.add(name=f"t{i}", dtype="float32", shape=shape)
    for _ in range(rng.randrange(4)):
        msg.route.add().peers.extend(f"10.0.0.{k}:5000" for k in range(rng.randrange(4)))
    msg.accumulate.extend(range(rng.randrange(5)))
    return msg.SerializeToString()


def test_a_small_header_is_judged_by_its_tensors_alone() -> None:
    """A header of no more bytes than MAX_HEADER_VALUES (every push's) is walked without its
    nested messages (issue 69): it is refused, or not, exactly as the whole walk would, whether
    it is honest, names too many tensors, is cut short or is garbage."""
    rng = random.Random(69)
    cases = [_push_header(rng) for _ in range(200)]
    cases += [c[: rng.randrange(len(c) + 1)] for c in cases[:100]]  # cut anywhere
    cases += [rng.randbytes(rng.randrange(1, 400)) for _ in range(200)]
    cases += [_empty_tensors(MAX_TENSORS_PER_MESSAGE + 1), _many_dims(MAX_HEADER_VALUES - 8)]
    refused = 0
    for data in cases:
        assert len(data) <= MAX_HEADER_VALUES
        for cls in (stage_pb2.StagePushRequest, stage_pb2.StagePushResponse, FORWARD):
            judged = _judged(data, cls, shallow=True)
            assert judged == _judged(data, cls, shallow=False), data
            refused += judged is not None
    assert refused > 0  # some were refused (too many tensors), as the whole walk refuses them


def test_only_a_type_nested_within_the_walks_bound_is_walked_shallow() -> None:
    for cls in (stage_pb2.StagePushRequest, stage_pb2.StagePushResponse, FORWARD):
        assert framing._nesting(cls.DESCRIPTOR) <= framing._MAX_DEPTH
    # A type that holds itself (Struct -> Value -> ListValue -> Value ...) can nest without
    # end: its headers are walked whole, so the depth bound still refuses them.
    assert framing._nesting(struct_pb2.Struct.DESCRIPTOR) == math.inf
