"""swarm.wire.chunking: split/receive round trips, every receive error, and a real gRPC echo."""

from __future__ import annotations

import asyncio
import gc
import types
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc
import pytest
import torch

from swarm.errors import ConfigError, InvalidArgument, NotFound, ResourceExhausted
from swarm.proto import stage_pb2, stage_pb2_grpc, tensor_pb2
from swarm.wire.chunking import (
    MAX_TENSORS_PER_MESSAGE,
    TENSOR_OVERHEAD_BYTES,
    Received,
    decode_named,
    receive,
    receive_reply,
    split,
    split_tensor,
)
from swarm.wire.codec import CODEC_FP16, CODEC_INT8_BLOCKWISE, decode, encode
from tests.support.echo import CHUNK_BYTES, LIMIT, echo

MiB = 1 << 20


async def stream_of(msgs: Iterable[Any], *, hang: bool = False) -> AsyncIterator[Any]:
    """The messages, then either end-of-stream or (like an open bidi stream) nothing forever."""
    for m in msgs:
        yield m
    if hang:
        await asyncio.Event().wait()


async def receive_list(msgs: Iterable[Any], max_bytes: int = 1 << 30) -> Received[Any]:
    return await asyncio.wait_for(receive(stream_of(msgs), max_bytes=max_bytes), timeout=10)


def forward_request(**tensors: torch.Tensor) -> stage_pb2.StageForwardRequest:
    return stage_pb2.StageForwardRequest(
        job="job-1",
        stage=2,
        microbatch=stage_pb2.MicrobatchId(step=7, index=3),
        reply_codec=CODEC_FP16,
        tensors=[encode(t, name) for name, t in tensors.items()],
    )


def header(*tensors: tensor_pb2.Tensor) -> stage_pb2.StageForwardRequest:
    return stage_pb2.StageForwardRequest(job="j", tensors=tensors)


def chunk(index: int, data: bytes) -> stage_pb2.StageForwardRequest:
    return stage_pb2.StageForwardRequest(chunk=tensor_pb2.Chunk(tensor=index, data=data))


def declared(nbytes: int, name: str = "x") -> tensor_pb2.Tensor:
    """A header tensor whose bytes follow in chunks."""
    return tensor_pb2.Tensor(name=name, dtype="uint8", shape=[nbytes], nbytes=nbytes)


# --- split / receive round trips -----------------------------------------------------------


async def test_small_message_is_sent_as_is() -> None:
    msg = forward_request(inputs=torch.randn(10), targets=torch.arange(4))
    parts = list(split(msg, 1024))
    assert len(parts) == 1
    assert parts[0] is msg
    got = await receive_list(parts)
    assert got.header is msg
    assert got.payloads == [t.data for t in msg.tensors]
    named = decode_named(got)
    assert torch.equal(named["targets"], torch.arange(4))


async def test_exactly_chunk_bytes_is_one_message_and_one_more_byte_splits() -> None:
    msg = header(encode(torch.zeros(100, dtype=torch.uint8), "x"))
    assert list(split(msg, 100)) == [msg]
    parts = list(split(msg, 99))
    assert [len(p.chunk.data) for p in parts[1:]] == [99, 1]


async def test_large_message_round_trip() -> None:
    inputs = torch.randn(25_000)  # 100 000 bytes: chunked
    targets = torch.arange(10)  # 80 bytes: stays inline
    empty = torch.zeros(0, 3)
    msg = forward_request(inputs=inputs, targets=targets, empty=empty)
    original = msg.SerializeToString()
    chunk_bytes = 16 * 1024
    parts = list(split(msg, chunk_bytes))
    assert msg.SerializeToString() == original  # the caller's message is untouched

    head = parts[0]
    assert type(head) is stage_pb2.StageForwardRequest
    assert not head.HasField("chunk")
    assert (head.job, head.stage, head.reply_codec) == ("job-1", 2, CODEC_FP16)
    assert (head.microbatch.step, head.microbatch.index) == (7, 3)
    assert [t.name for t in head.tensors] == ["inputs", "targets", "empty"]
    assert [t.nbytes for t in head.tensors] == [100_000, 80, 0]
    assert head.tensors[0].data == b""
    assert head.tensors[1].data == msg.tensors[1].data
    assert list(head.tensors[0].shape) == [25_000]
    assert head.tensors[0].dtype == "float32"

    chunks = parts[1:]
    assert len(chunks) == -(-100_000 // chunk_bytes)
    for c in chunks:
        # encoded as protobuf encodes a StageForwardRequest holding only this chunk
        parsed = stage_pb2.StageForwardRequest.FromString(c.SerializeToString())
        assert parsed.SerializeToString() == c.SerializeToString()
        assert not parsed.tensors and not parsed.job
        assert parsed.chunk.tensor == c.chunk.tensor == 0
        assert parsed.chunk.data == c.chunk.data
        assert 0 < len(c.chunk.data) <= chunk_bytes
    assert b"".join(c.chunk.data for c in chunks) == msg.tensors[0].data

    got = await receive_list(parts)
    assert got.header == head
    payload = got.payloads[0]
    assert isinstance(payload, memoryview) and not payload.readonly  # a buffer of its own
    named = decode_named(got)
    # decoded without a copy, and writable: the receiver may sum into it
    assert named["inputs"].data_ptr() == torch.frombuffer(payload, dtype=torch.uint8).data_ptr()
    assert set(named) == {"inputs", "targets", "empty"}
    assert torch.equal(named["inputs"], inputs)
    assert torch.equal(named["targets"], targets)
    assert named["empty"].shape == (0, 3)


async def test_owned_tensors_are_the_callers_without_a_copy_of_what_came_chunked() -> None:
    """`decode_named(owned=True)`: every tensor is the caller's to keep and write to. A chunked
    one is its receive buffer as it is (the state paths cloned every tensor of a state they
    received: a second copy of the whole state); an inline one is copied out of its message,
    whose bytes are immutable."""
    big, small = torch.randn(25_000), torch.arange(10)
    got = await receive_list(list(split(forward_request(big=big, small=small), 16 * 1024)))
    shared = decode_named(got)
    owned = decode_named(got, owned=True)
    assert owned["big"].data_ptr() == shared["big"].data_ptr()  # no copy
    assert owned["small"].data_ptr() != shared["small"].data_ptr()  # out of the message
    for name, t in owned.items():
        t.add_(1)  # writable, and the caller's
        assert torch.equal(t, {"big": big, "small": small}[name] + 1)
    assert torch.equal(decode_named(got)["small"], small)  # the message itself is untouched


async def test_several_large_tensors_are_chunked_in_order() -> None:
    a, b = torch.randn(3000), torch.randn(2000, dtype=torch.float64)
    msg = forward_request(a=a, b=b)
    parts = list(split(msg, 5000))
    indices = [p.chunk.tensor for p in parts[1:]]
    assert indices == sorted(indices) == [0, 0, 0, 1, 1, 1, 1]
    named = decode_named(await receive_list(parts))
    assert torch.equal(named["a"], a) and torch.equal(named["b"], b)


async def test_chunk_multiple_of_tensor_size_and_lossy_codecs() -> None:
    t = torch.randn(4096)
    msg = stage_pb2.StageForwardRequest(tensors=[encode(t, "q", CODEC_INT8_BLOCKWISE, 512)])
    size = len(msg.tensors[0].data)
    parts = list(split(msg, size // 4 + 1))
    assert len(parts) == 1 + 4
    got = await receive_list(parts)
    assert torch.equal(decode_named(got)["q"], decode(msg.tensors[0]))


async def test_response_types_keep_their_other_fields() -> None:
    receipt = stage_pb2.Receipt(peer="p", stage=1, microbatch=stage_pb2.MicrobatchId(step=3))
    msg = stage_pb2.StageForwardBackwardResponse(
        tensors=[encode(torch.randn(1000), "grad_inputs")], receipt=receipt, loss_sum=1.5
    )
    parts = list(split(msg, 1000))
    assert type(parts[0]) is stage_pb2.StageForwardBackwardResponse
    for part in parts:  # the chunks too are that type's encodings
        stage_pb2.StageForwardBackwardResponse.FromString(part.SerializeToString())
    got = await receive_list(parts)
    assert got.header.receipt == receipt
    assert got.header.loss_sum == 1.5
    assert torch.equal(decode_named(got)["grad_inputs"], decode(msg.tensors[0]))


async def test_message_without_tensors() -> None:
    msg = stage_pb2.StageBackwardResponse(receipt=stage_pb2.Receipt(peer="p"))
    assert list(split(msg, 1)) == [msg]
    got = await receive_list([msg])
    assert got.header is msg and got.payloads == []


async def test_receive_does_not_wait_for_end_of_stream() -> None:
    msg = forward_request(inputs=torch.randn(5000))
    parts = list(split(msg, 4096))
    extra = stage_pb2.StageForwardRequest(job="next")
    it = stream_of([*parts, extra], hang=True)
    got = await asyncio.wait_for(receive(it, max_bytes=1 << 20), timeout=5)
    assert torch.equal(decode_named(got)["inputs"], decode(msg.tensors[0]))
    # It read exactly the message's parts: the next message is still there.
    assert await anext(it) == extra
    # A small message, too, returns without end-of-stream.
    small = forward_request(x=torch.ones(2))
    it = stream_of([small], hang=True)
    got = await asyncio.wait_for(receive(it, max_bytes=100 + TENSOR_OVERHEAD_BYTES), 5)
    assert got.header is small


def test_split_rejects_nonpositive_chunk_bytes() -> None:
    with pytest.raises(ConfigError, match="chunk_bytes"):
        list(split(forward_request(x=torch.ones(2)), 0))


# --- receive errors ------------------------------------------------------------------------


async def test_empty_stream() -> None:
    with pytest.raises(InvalidArgument, match="empty stream"):
        await receive_list([])


async def test_first_message_is_a_chunk() -> None:
    with pytest.raises(InvalidArgument, match="header"):
        await receive_list([chunk(0, b"abc")])


async def test_declared_bytes_above_max_bytes_before_allocating() -> None:
    # 1 PB declared: must fail on the limit, not with MemoryError.
    with pytest.raises(ResourceExhausted, match=f"{10**15} tensor bytes in 1 tensors .* of 100$"):
        await receive_list([header(declared(10**15))], max_bytes=100)
    # Inline and chunked bytes both count.
    inline = encode(torch.zeros(60, dtype=torch.uint8), "a")
    with pytest.raises(ResourceExhausted, match="110 tensor bytes"):
        await receive_list([header(inline, declared(50, "b"))], max_bytes=100)
    # Each tensor is charged TENSOR_OVERHEAD_BYTES more than its payload.
    limit = 100 + 2 * TENSOR_OVERHEAD_BYTES
    got = await receive_list([header(inline, declared(40, "b")), chunk(1, b"z" * 40)], limit)
    assert got.payloads[1] == b"z" * 40


async def test_a_header_is_admitted_and_its_bytes_reserved_before_anything_is_allocated() -> None:
    # 1 PB declared, within max_bytes: `admit` and `reserve` refuse it from the header, before a
    # buffer (which would be a MemoryError) is allocated or a chunk read.
    seen: list[Any] = []

    def refuse_route(h: Any) -> None:
        seen.append(h.job)
        raise NotFound(f"job {h.job!r} is not served here")

    reserved: list[int] = []

    def refuse_bytes(nbytes: int) -> None:
        reserved.append(nbytes)
        raise ResourceExhausted("over budget")

    msgs = stream_of([header(declared(10**15))], hang=True)  # its chunks never come
    with pytest.raises(NotFound, match="'j' is not served"):
        await asyncio.wait_for(receive(msgs, max_bytes=10**16, admit=refuse_route), 5)
    msgs = stream_of([header(declared(10**15))], hang=True)
    with pytest.raises(ResourceExhausted, match="over budget"):
        await asyncio.wait_for(
            receive(msgs, max_bytes=10**16, admit=seen.append, reserve=refuse_bytes), 5
        )
    assert reserved == [10**15 + TENSOR_OVERHEAD_BYTES] and len(seen) == 2
    # Past max_bytes it is refused before `reserve` is asked, naming the setting.
    with pytest.raises(ResourceExhausted, match=r"limit of 100 \(--max-tensor-bytes\)"):
        await receive(
            stream_of([header(declared(101))]),
            max_bytes=100,
            reserve=refuse_bytes,
            limit_name="--max-tensor-bytes",
        )
    assert reserved == [10**15 + TENSOR_OVERHEAD_BYTES]
    # Admitted and reserved: received as before; decoding reserves what a lossy codec widens.
    small = forward_request(a=torch.ones(8, dtype=torch.uint8))
    taken: list[int] = []
    got = await receive(
        stream_of([small]),
        max_bytes=100 + TENSOR_OVERHEAD_BYTES,
        admit=seen.append,
        reserve=taken.append,
    )
    assert taken == [8 + TENSOR_OVERHEAD_BYTES]
    half = header(encode(torch.ones(10), "h", CODEC_FP16), encode(torch.ones(3), "n"))
    got = await receive_list([half])
    assert set(decode_named(got, reserve=taken.append)) == {"h", "n"}
    assert taken == [8 + TENSOR_OVERHEAD_BYTES, 40]


@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 4096])
@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(300, dtype=torch.float32).reshape(3, 100),
        torch.tensor(2.5, dtype=torch.float64),
        torch.zeros(0, 4),
        torch.tensor([True, False, True]),
        torch.randn(5, 7).to(torch.bfloat16),
        torch.randn(8, 6).t(),  # not contiguous
    ],
)
def test_split_tensor_sends_what_split_sends_of_the_encoded_tensor(
    tensor: torch.Tensor, chunk_bytes: int
) -> None:
    def reply() -> stage_pb2.StageForwardResponse:
        return stage_pb2.StageForwardResponse(queued_seconds=0.5)

    encoded = reply()
    encoded.tensors.append(encode(tensor, "t"))
    assert list(split_tensor(reply(), "t", tensor, chunk_bytes)) == list(
        split(encoded, chunk_bytes)
    )


async def test_chunk_for_unknown_tensor() -> None:
    with pytest.raises(InvalidArgument, match="tensor 1, but the header has 1"):
        await receive_list([header(declared(10)), chunk(1, b"x")])


async def test_chunk_for_inline_tensor() -> None:
    inline = encode(torch.zeros(4, dtype=torch.uint8), "a")
    with pytest.raises(InvalidArgument, match="inline"):
        await receive_list([header(inline, declared(10, "b")), chunk(0, b"x")])


async def test_chunk_for_complete_tensor() -> None:
    msgs = [header(declared(4, "a"), declared(4, "b")), chunk(0, b"1234"), chunk(0, b"5")]
    with pytest.raises(InvalidArgument, match="already complete"):
        await receive_list(msgs)


async def test_chunk_overflowing_its_tensor() -> None:
    msgs = [header(declared(4, "a"), declared(4, "b")), chunk(0, b"12"), chunk(0, b"345")]
    with pytest.raises(InvalidArgument, match="overflows tensor 0: 5 bytes of 4"):
        await receive_list(msgs)


async def test_stream_ending_early() -> None:
    msgs = [header(declared(10, "a"), declared(5, "b")), chunk(0, b"x" * 10), chunk(1, b"yy")]
    with pytest.raises(InvalidArgument, match="stream ended after 12 of 15 bytes"):
        await receive_list(msgs)
    with pytest.raises(InvalidArgument, match="stream ended after 0 of 10 bytes"):
        await receive_list([header(declared(10))])


async def test_non_chunk_message_after_header() -> None:
    with pytest.raises(InvalidArgument, match="expected a chunk"):
        await receive_list([header(declared(10)), header(declared(10))])
    with pytest.raises(InvalidArgument, match="expected a chunk"):
        await receive_list([header(declared(10)), stage_pb2.StageForwardRequest(job="j")])


async def test_empty_chunk() -> None:
    with pytest.raises(InvalidArgument, match="empty chunk"):
        await receive_list([header(declared(10)), chunk(0, b"")])


async def test_inconsistent_header_tensors() -> None:
    bad = tensor_pb2.Tensor(name="a", data=b"abc", nbytes=5)
    with pytest.raises(InvalidArgument, match="nbytes 5 but 3 inline bytes"):
        await receive_list([header(bad)])
    with pytest.raises(InvalidArgument, match="negative nbytes"):
        await receive_list([header(tensor_pb2.Tensor(name="a", nbytes=-1))])


@pytest.mark.timeout(20)
async def test_a_header_of_many_equally_named_tensors_is_refused_at_once() -> None:
    # A hostile header of 200,000 empty tensors all named "x" (about 1 MB): the duplicate check
    # counted each name over the whole list, 4e10 steps that froze an event loop for hours on
    # every server (and on the scheduler, through a member's DownloadState reply). Now refused
    # from its count, before any name is looked at.
    empty = tensor_pb2.Tensor(name="x", dtype="float32", nbytes=0)
    with pytest.raises(InvalidArgument, match="200000 tensors, more than 64 a message"):
        await receive_list([header(*([empty] * 200_000))])
    with pytest.raises(InvalidArgument, match="200000 tensors, more than 64 a message"):
        decode_named(Received(header(*([empty] * 200_000)), [b""] * 200_000))
    got = await receive_list([header(*([empty] * MAX_TENSORS_PER_MESSAGE))])
    with pytest.raises(InvalidArgument, match="duplicate tensor names: \\['x'\\]"):
        decode_named(got)
    many = [tensor_pb2.Tensor(name=f"t{i % 32}", dtype="float32") for i in range(64)]
    with pytest.raises(InvalidArgument, match=r"32 duplicate tensor names: \['t0', .*\.\.\.\]"):
        decode_named(await receive_list([header(*many)]))


async def test_interleaved_chunks_are_accepted() -> None:
    msgs = [header(declared(4, "a"), declared(2, "b"))]
    msgs += [chunk(0, b"12"), chunk(1, b"x"), chunk(0, b"34"), chunk(1, b"y")]
    got = await receive_list(msgs)
    assert got.payloads == [bytearray(b"1234"), bytearray(b"xy")]


async def test_decode_named_errors() -> None:
    dup = header(encode(torch.ones(2), "x"), encode(torch.zeros(2), "x"))
    with pytest.raises(InvalidArgument, match="duplicate tensor names: \\['x'\\]"):
        decode_named(await receive_list([dup]))
    two = header(encode(torch.ones(2), "a"), encode(torch.zeros(3), "b"))  # 8 + 12 bytes
    got = await receive_list([two])
    assert set(decode_named(got, max_bytes=20)) == {"a", "b"}
    with pytest.raises(ResourceExhausted, match="20 bytes, above the limit of 19"):
        decode_named(got, max_bytes=19)


# --- a real gRPC round trip ----------------------------------------------------------------


async def test_grpc_echo_small_and_chunked(stub: stage_pb2_grpc.StageServiceStub) -> None:
    small = torch.arange(10, dtype=torch.int64)
    got = await echo(stub, [forward_request(targets=small)])
    assert torch.equal(decode_named(got)["targets"], small)
    big = torch.randn(3 * MiB)  # 12 MiB: three 4 MiB chunks each way
    got = await echo(stub, split(forward_request(inputs=big), CHUNK_BYTES))
    assert torch.equal(decode_named(got)["inputs"], big)


async def test_grpc_truncated_stream_is_invalid_argument(
    stub: stage_pb2_grpc.StageServiceStub,
) -> None:
    call = stub.Forward(timeout=30)
    await call.write(header(declared(100)))
    await call.write(chunk(0, b"x" * 40))
    await call.done_writing()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await receive(call, max_bytes=LIMIT)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stream ended after 40 of 100 bytes" in (info.value.details() or "")


async def test_grpc_oversized_declaration_is_resource_exhausted(
    stub: stage_pb2_grpc.StageServiceStub,
) -> None:
    call = stub.Forward(timeout=30)
    await call.write(header(declared(LIMIT + 1)))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await receive(call, max_bytes=LIMIT)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_a_header_of_many_tiny_tensors_is_refused_before_any_is_decoded() -> None:
    # The review's repro (issue 27): a message of a great many one-byte tensors carries little
    # payload, but each is a torch tensor (hundreds of bytes) once decoded. Past
    # MAX_TENSORS_PER_MESSAGE it is refused from its header, before admit, reserve or decoding.
    tiny = [encode(torch.zeros((), dtype=torch.uint8), f"k{i}") for i in range(10_000)]
    seen: list[Any] = []
    with pytest.raises(InvalidArgument, match=r"10000 tensors, more than 64 a message"):
        await receive(stream_of([header(*tiny)]), max_bytes=1 << 30, admit=seen.append)
    assert not seen
    with pytest.raises(InvalidArgument, match=r"10000 tensors, more than 64 a message"):
        decode_named(Received(header(*tiny), [b"\0"] * len(tiny)))
    # Within the count, each tensor is charged TENSOR_OVERHEAD_BYTES on top of its payload,
    # against max_bytes and in what is reserved.
    few = tiny[:MAX_TENSORS_PER_MESSAGE]
    taken: list[int] = []
    charged = MAX_TENSORS_PER_MESSAGE * (1 + TENSOR_OVERHEAD_BYTES)
    with pytest.raises(ResourceExhausted, match=rf"64 tensor bytes in 64 tensors \({charged} "):
        await receive(stream_of([header(*few)]), max_bytes=charged - 1, reserve=taken.append)
    got = await receive(stream_of([header(*few)]), max_bytes=charged, reserve=taken.append)
    assert taken == [charged] and len(decode_named(got)) == MAX_TENSORS_PER_MESSAGE


def _suspended_on_a_message() -> int:
    """gRPC response streams (`_fetch_stream_responses`) suspended with a message in hand."""
    return sum(
        1
        for o in gc.get_objects()
        if type(o) is types.AsyncGeneratorType
        and o.ag_frame is not None
        and o.ag_code.co_name == "_fetch_stream_responses"
        and o.ag_frame.f_locals.get("message") is not None
    )


async def test_a_reply_read_to_its_end_holds_no_chunk(
    stub: stage_pb2_grpc.StageServiceStub,
) -> None:
    """`receive_reply` reads a reply and then its stream's end, so gRPC lets go of the last
    chunk as the call returns; `receive` alone leaves the stream suspended on it (a chunk of up
    to `chunk_bytes`) until the garbage collector finds the call, which can be long (off here,
    so that a reference cycle shows)."""
    big = torch.randn(3 * MiB)  # 12 MiB: three chunks of 4 MiB back

    async def left_holding(read: Any) -> int:
        gc.collect()
        gc.disable()
        try:
            for _ in range(3):
                call = stub.Forward(timeout=60)
                for m in split(forward_request(inputs=big), CHUNK_BYTES):
                    await call.write(m)
                await call.done_writing()
                got = await read(call)
                assert torch.equal(decode_named(got)["inputs"], big)
                del got, call
            await asyncio.sleep(0.1)
            return _suspended_on_a_message()
        finally:
            gc.enable()

    assert await left_holding(lambda call: receive(call.__aiter__(), max_bytes=LIMIT)) == 3
    assert await left_holding(lambda call: receive_reply(call, max_bytes=LIMIT)) == 0
