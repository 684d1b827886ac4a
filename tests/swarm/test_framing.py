"""`swarm.proto.framing`: a chunk is encoded exactly as protobuf encodes it, read back as a view
of the received bytes, and anything else is protobuf's to read (and to refuse)."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf.message import DecodeError

from swarm.proto import framing, pool_pb2, scheduler_pb2, stage_pb2, tensor_pb2
from swarm.proto.framing import Framed

STREAMED = [
    pool_pb2.PoolReduceRequest,
    pool_pb2.PoolReduceResponse,
    stage_pb2.StageForwardRequest,
    stage_pb2.StageBackwardResponse,
    stage_pb2.StageLoadStateRequest,
    stage_pb2.StageDownloadStateResponse,
    stage_pb2.StageUpdatesResponse,
    scheduler_pb2.SchedulerExportModelResponse,
]


def chunk_message(cls: Any, tensor: int, data: bytes) -> Any:
    msg = cls()
    msg.chunk.tensor, msg.chunk.data = tensor, data
    return msg


@pytest.mark.parametrize("cls", STREAMED, ids=lambda c: c.__name__)
@pytest.mark.parametrize("tensor", [0, 1, 300, 2**32 - 1])
@pytest.mark.parametrize("size", [1, 127, 128, 70_000])
def test_a_frame_is_protobufs_own_encoding_and_reads_back_as_a_view(
    cls: Any, tensor: int, size: int
) -> None:
    data = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
    framed = framing.frame(cls, tensor, memoryview(bytearray(data)))
    expected = chunk_message(cls, tensor, data).SerializeToString()
    assert framing.serialize(framed) == expected
    assert (framed.tensor, bytes(framed.data)) == (tensor, data)

    received = framing.deserializer(cls)(expected)
    assert isinstance(received, Framed)
    assert (received.chunk.tensor, bytes(received.chunk.data)) == (tensor, data)
    assert received.HasField("chunk") and not received.tensors
    assert isinstance(received.data, memoryview) and received.data.obj is expected  # no copy


def test_a_frame_copies_its_data_once_when_made() -> None:
    source = bytearray(b"abcd")
    framed = framing.frame(stage_pb2.StageForwardRequest, 0, memoryview(source))
    source[:] = b"zzzz"  # a tensor changed after its chunk was cut: the chunk keeps what was cut
    assert bytes(framed.data) == b"abcd"


@pytest.mark.parametrize(
    "msg",
    [
        # a header: tensors and other fields
        stage_pb2.StageForwardRequest(
            job="j", stage=1, tensors=[tensor_pb2.Tensor(name="x", nbytes=8, data=b"12345678")]
        ),
        # a chunk beside another field
        pool_pb2.PoolReduceRequest(job="j", chunk=tensor_pb2.Chunk(tensor=0, data=b"xy")),
        # a chunk without data (chunking refuses it with its own words)
        chunk_message(stage_pb2.StageForwardRequest, 2, b""),
        # no fields at all
        stage_pb2.StageForwardRequest(),
    ],
    ids=["header", "chunk-and-job", "empty-chunk", "empty"],
)
def test_anything_but_a_lone_chunk_is_protobufs_to_read(msg: Any) -> None:
    encoded = msg.SerializeToString()
    got = framing.deserializer(type(msg))(encoded)
    assert type(got) is type(msg) and got == msg


def test_odd_encodings_of_a_chunk_go_to_protobuf_which_reads_them_as_it_always_did() -> None:
    cls = stage_pb2.StageForwardRequest
    one = chunk_message(cls, 1, b"first").SerializeToString()
    two = chunk_message(cls, 2, b"second").SerializeToString()
    # the chunk field twice: protobuf merges them; the fast path must not pick one
    merged = framing.deserializer(cls)(one + two)
    assert type(merged) is cls and merged == cls.FromString(one + two)
    # the data field twice inside one chunk: the last wins in protobuf
    inner = b"\x12\x01a\x12\x01b"
    outer = bytes([(5 << 3) | 2, len(inner)]) + inner
    got = framing.deserializer(cls)(outer)
    assert type(got) is cls and got.chunk.data == b"b"


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x2a\x05\x12\x09abc",  # the data field's length runs past the chunk
        b"\x2a\x7f\x12\x01a",  # the chunk's length runs past the message
        b"\x2a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",  # a varint over 10 bytes
        b"\x2a",  # cut off after the key
    ],
)
def test_malformed_bytes_are_refused_by_protobuf_not_read_as_a_chunk(garbage: bytes) -> None:
    with pytest.raises(DecodeError):
        framing.deserializer(stage_pb2.StageForwardRequest)(garbage)


def test_a_tensor_index_beyond_uint32_is_not_a_chunk_of_ours() -> None:
    inner = b"\x08" + b"\x80\x80\x80\x80\x10" + b"\x12\x01a"  # tensor = 2**32
    outer = bytes([(5 << 3) | 2, len(inner)]) + inner
    got = framing.deserializer(stage_pb2.StageForwardRequest)(outer)
    assert not isinstance(got, Framed)


def test_messages_without_a_chunk_field_parse_as_protobuf() -> None:
    parse = framing.deserializer(scheduler_pb2.SchedulerDeleteJobRequest)
    assert parse == scheduler_pb2.SchedulerDeleteJobRequest.FromString
    with pytest.raises(ValueError, match="no 'chunk' field"):
        framing.frame(scheduler_pb2.SchedulerDeleteJobRequest, 0, b"x")
    msg = scheduler_pb2.SchedulerDeleteJobRequest(job="j")
    assert framing.serialize(msg) == msg.SerializeToString()


def test_a_received_chunk_cannot_be_sent_as_is() -> None:
    encoded = chunk_message(stage_pb2.StageForwardRequest, 0, b"abc").SerializeToString()
    received = framing.deserializer(stage_pb2.StageForwardRequest)(encoded)
    with pytest.raises(ValueError, match="no encoding"):
        framing.serialize(received)
