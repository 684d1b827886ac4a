"""Chunked streaming of messages that carry tensors.

Every streamed message type has `tensors` (repeated Tensor) and `chunk` (Chunk) fields. A message
whose tensor bytes fit in `chunk_bytes` travels as is; a larger one becomes a header (all fields,
with the data of large tensors left empty and `nbytes` set) followed by chunk-only messages that
carry those bytes in order. `receive` reads exactly the messages it needs and never waits for the
end of the stream, since a bidi peer keeps its side open to read the reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
from collections import Counter
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
from google.protobuf.message import Message

from swarm.deadline import within
from swarm.errors import ConfigError, DeadlineExceeded, InvalidArgument, ResourceExhausted
from swarm.proto import framing, tensor_pb2
from swarm.proto.framing import MAX_TENSORS_PER_MESSAGE  # counted before a header is parsed
from swarm.wire.codec import CODEC_HADAMARD3, CODEC_NONE, decode, decoded_nbytes, dtype_name
from swarm.wire.off_loop import on_thread
from swarm.wire.reassembly import Body, Handed, Into, buffer, tensor_bytes

__all__ = [
    "HADAMARD_WEIGHT",
    "MAX_TENSORS_PER_MESSAGE",
    "OFF_LOOP_VALUES",
    "TENSOR_OVERHEAD_BYTES",
    "EndOfStream",
    "Received",
    "buffer",
    "decode_async",
    "decode_named",
    "decode_named_async",
    "grpc_options",
    "read_to_end",
    "receive",
    "receive_reply",
    "split",
    "split_cuts",
    "split_tensor",
    "tensor_bytes",
    "within_deadline",
]

M = TypeVar("M", bound=Message)

# What a received tensor costs beyond its payload (its header, the torch tensor and the name it
# is kept under): charged to a message's size and to what it reserves, so that many tiny tensors
# do not pass a byte limit meant for their memory.
TENSOR_OVERHEAD_BYTES = 512
# A request's lossy tensors are widened on a thread from this much work on (`decode_named_async`),
# counted in values of a cheap widening (int8_blockwise's: 4 ms for 4M values here); hadamard3's
# inverse rotation costs about 20 times as much a value (98 ms for 4M), so it counts 16. Below
# it (about a millisecond) the loop decodes in place: a thread's hop would cost as much.
OFF_LOOP_VALUES = 1 << 20
HADAMARD_WEIGHT = 16

_SKIP_MSG = frozenset({"tensors", "chunk"})
_SKIP_TENSOR = frozenset({"data"})


class EndOfStream(InvalidArgument):
    """The stream ended before a header: an error for a request, the normal end of a
    server-streamed response that carries several messages (e.g. DownloadState)."""


@dataclass
class Received(Generic[M]):
    """A reassembled message: the header as received and one payload per `header.tensors`
    (inline bytes as received; a chunked tensor's bytes in a writable buffer)."""

    header: M
    payloads: list[bytes | memoryview | torch.Tensor]  # a tensor: handed over (`Handed`)


def _copy_fields(src: Message, dst: Message, skip: frozenset[str]) -> None:
    # Field by field rather than CopyFrom: a CopyFrom would duplicate the large tensor bytes.
    for field, value in src.ListFields():
        if field.name in skip:
            continue
        if field.is_repeated or field.message_type is not None:
            getattr(dst, field.name).MergeFrom(value)
        else:
            setattr(dst, field.name, value)


def split(msg: M, chunk_bytes: int) -> Iterator[M | framing.Framed]:
    """Yield `msg` itself if its tensor bytes fit in `chunk_bytes`, else a header and chunks.

    Small tensors stay inline in the header while their total fits in `chunk_bytes`; the others
    follow as `Chunk`s of at most `chunk_bytes` bytes, tensor by tensor, in order.
    """
    if chunk_bytes <= 0:
        raise ConfigError(f"chunk_bytes must be positive, got {chunk_bytes}")
    m: Any = msg
    # Each access to a protobuf bytes field copies it: read every tensor's data exactly once.
    datas: list[bytes] = [t.data for t in m.tensors]
    if sum(len(d) for d in datas) <= chunk_bytes:
        yield msg
        return
    header: Any = type(msg)()
    _copy_fields(msg, header, _SKIP_MSG)
    budget = chunk_bytes
    chunked: list[int] = []
    for i, (t, data) in enumerate(zip(m.tensors, datas, strict=True)):
        ht = header.tensors.add()
        _copy_fields(t, ht, _SKIP_TENSOR)
        ht.nbytes = t.nbytes if t.HasField("handover") else len(data)  # handed: no data
        if len(data) <= budget:
            ht.data = data
            budget -= len(data)
        else:
            chunked.append(i)
    yield header
    cls: Any = type(msg)
    for i in chunked:
        view = memoryview(datas[i])
        for start in range(0, len(view), chunk_bytes):
            # Encoded as it will travel, copying the piece once (`swarm.proto.framing`).
            yield framing.frame(cls, i, view[start : start + chunk_bytes])


def split_tensor(
    header: M,
    name: str,
    tensor: torch.Tensor | Callable[[], torch.Tensor],
    chunk_bytes: int,
    lock: AbstractContextManager[Any] | None = None,
) -> Iterator[M | framing.Framed]:
    """`split` of `header` carrying `tensor` as `name` (CODEC_NONE), each chunk cut from the
    tensor's own memory: a large tensor is never encoded whole (one chunk's copy at a time), so a
    reply of many such tensors is built as it is sent, not before. `header` (a message without
    tensors) gets the tensor's metadata; the messages are those `split` makes of `header` with
    `encode(tensor, name)`, so a receiver tells no difference. `tensor` may be a function giving
    it, asked again for every chunk under `lock` (a snapshot that may swap a tensor for a copy of
    it between chunks: `stage_server.replica.snapshot`)."""
    if chunk_bytes <= 0:
        raise ConfigError(f"chunk_bytes must be positive, got {chunk_bytes}")
    if callable(tensor):
        current = tensor
    else:
        host = tensor.detach().cpu().contiguous()  # once, not a copy a chunk

        def current() -> torch.Tensor:
            return host

    guard = lock if lock is not None else contextlib.nullcontext()

    cls = type(header)

    def cut(start: int) -> tuple[torch.Tensor, framing.Framed | bytes]:
        """The tensor and its chunk at `start`, copied once while `lock` is held: as a chunk,
        or as `bytes` for the header when the whole tensor fits in one chunk."""
        with guard:
            t = current()
            # reshape(-1) first: a 0-dim tensor cannot be viewed as a dtype of another size.
            flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            piece = flat[start : start + chunk_bytes]
            if t.nbytes <= chunk_bytes:
                return t, piece.numpy().tobytes()
            return t, framing.frame(cls, 0, tensor_bytes(piece))

    yield from split_cuts(header, name, chunk_bytes, cut)


def split_cuts(
    header: M,
    name: str,
    chunk_bytes: int,
    cut: Callable[[int], tuple[torch.Tensor, framing.Framed | bytes]],
) -> Iterator[M | framing.Framed]:
    """`split_tensor`'s messages, however the chunks are cut: `cut(start)` gives the tensor as it
    is now and its chunk at byte `start`, or `bytes` for the header when the whole tensor fits in
    one chunk. The first cut's tensor gives the metadata; each later chunk is cut only as it is
    sent (`stage_server.averaging.staging` copies it off a device then, one chunk at a time)."""
    first, part = cut(0)
    m: Any = header
    meta = m.tensors.add()
    meta.name, meta.dtype, meta.nbytes = name, dtype_name(first.dtype), first.nbytes
    meta.shape.extend(first.shape)
    if isinstance(part, bytes):
        meta.data = part
        yield header
        return
    yield header
    for start in range(0, first.nbytes, chunk_bytes):
        yield part if start == 0 else cut(start)[1]


def _check_count(header: Any) -> None:
    count = len(header.tensors)
    if count > MAX_TENSORS_PER_MESSAGE:
        raise InvalidArgument(
            f"a message of {count} tensors, more than {MAX_TENSORS_PER_MESSAGE} a message "
            "(MAX_TENSORS_PER_MESSAGE)"
        )


async def receive_reply(call: Any, **kwargs: Any) -> Received[M]:
    """`receive` of a call's one reply, then the end of its stream (`read_to_end`)."""
    stream = call.__aiter__()  # the call's one iterator
    received: Received[M] = await receive(stream, **kwargs)
    await read_to_end(stream, "the reply's")
    return received


async def read_to_end(stream: AsyncIterator[Any], what: str) -> None:
    """The end of a stream whose one message `receive` read (`what`: whose, for the refusal of
    a message after it). gRPC holds the last message it read (a whole chunk) while its stream is
    suspended on it, which a call read only up to its last chunk is until the garbage collector
    finds the call: read to the end, the chunk goes as the call does."""
    it = stream.__aiter__()
    with contextlib.suppress(StopAsyncIteration):
        await _next(it)
        raise InvalidArgument(f"a message after {what} last chunk")


async def _next(it: AsyncIterator[Any]) -> Any:
    """`it`'s next message. A header refused before it was parsed (the deserializer gives a
    `framing.HeaderRefused` in its place) is the sender's InvalidArgument; so is a message gRPC
    could not read at all, which a client's stream yields as None."""
    message = await it.__anext__()
    if isinstance(message, framing.HeaderRefused):
        raise InvalidArgument(str(message))
    if message is None:
        raise InvalidArgument("a message that could not be read (malformed, or refused unparsed)")
    return message


async def receive(
    stream: AsyncIterable[M],
    *,
    max_bytes: int,
    admit: Callable[[M], None] | None = None,
    reserve: Callable[[int], None] | None = None,
    limit_name: str = "",
    tensor_overhead: int = TENSOR_OVERHEAD_BYTES,
    into: Into | None = None,
    handed: Handed | None = None,
) -> Received[M]:
    """Read one (possibly chunked) message from `stream` and reassemble its tensor payloads.

    Reads the header, then exactly the chunks needed to complete every tensor. Before a byte of
    the body is allocated or read: a header of more than MAX_TENSORS_PER_MESSAGE tensors is
    refused (InvalidArgument), `admit(header)` may refuse the message by raising (its route, a
    full replica), the declared bytes, with `tensor_overhead` more a tensor, are checked
    against `max_bytes` (ResourceExhausted; the refusal says `limit_name`, the setting behind
    it), and `reserve(those bytes)` may refuse them too (a process's `swarm.wire.budget`).
    A server reads its requests `within_deadline`. Raises InvalidArgument for an empty or truncated
    stream or a chunk that does not fit the header. A chunked tensor's bytes are written where
    `into` says (the caller's own tensor: a reply lands where it is used), else in a new
    `buffer`; each chunk is copied once, into place. A tensor handed over on this host
    (`swarm.device.handover`) is taken by `handed`, after those checks; without it, refused.
    """
    it = stream.__aiter__()
    try:
        first = await _next(it)
    except StopAsyncIteration:
        raise EndOfStream("empty stream: expected a header message") from None
    _check_header(first)
    if admit is not None:
        admit(first)
    body = Body(first, handed)
    charged = _charged(body.sizes, max_bytes, tensor_overhead, limit_name)
    if reserve is not None:
        reserve(charged)
    body.place(into)
    received = 0
    while received < body.to_come:
        try:
            chunk = await _next(it)
        except StopAsyncIteration:
            raise InvalidArgument(
                f"stream ended after {received} of {body.to_come} bytes"
            ) from None
        received += body.take(chunk)
    return Received(header=first, payloads=body.payloads)


def _check_header(header: Any) -> None:
    """A stream's first message must be a header of at most MAX_TENSORS_PER_MESSAGE tensors
    (counted before anything it declares is believed)."""
    if header.HasField("chunk"):
        raise InvalidArgument("the first message of a stream must be a header, got a chunk")
    _check_count(header)


def _charged(sizes: list[int], max_bytes: int, tensor_overhead: int, limit_name: str) -> int:
    """What a message declaring tensors of `sizes` bytes costs (`tensor_overhead` more a
    tensor: many tiny tensors cost their headers too); ResourceExhausted above `max_bytes`,
    naming the setting behind it."""
    total = sum(sizes)
    charged = total + tensor_overhead * len(sizes)
    if charged > max_bytes:
        named = f" ({limit_name})" if limit_name else ""
        raise ResourceExhausted(
            f"message declares {total} tensor bytes in {len(sizes)} tensors ({charged} with "
            f"{tensor_overhead} bytes a tensor), above the limit of {max_bytes}{named}"
        )
    return charged


async def within_deadline(
    stream: AsyncIterable[M], timeout_s: float, limit_name: str
) -> AsyncIterator[M]:
    """`stream`'s messages: the first (a request's header, from which `receive` reserves its
    body's bytes) within `timeout_s` of the call's start, every one after within `timeout_s` of
    that first; else DeadlineExceeded naming `limit_name`. A server's defence against a caller
    with no deadline of its own that declares a body, so holds its share of the receive
    budget, and never sends it; or that sends nothing at all, and holds one of the server's
    concurrent calls for as long as its connection lives."""
    it = stream.__aiter__()
    try:
        first = await within(it.__anext__(), timeout_s)
    except StopAsyncIteration:
        return
    except TimeoutError:
        raise DeadlineExceeded(
            f"the request's header did not come within {timeout_s:g} s of the call's start "
            f"({limit_name}): the call is ended"
        ) from None
    yield first
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            message = await within(it.__anext__(), max(deadline - loop.time(), 0.0))
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise DeadlineExceeded(
                f"the request's body did not come within {timeout_s:g} s of its header "
                f"({limit_name}): the call is ended and the bytes it declared given back"
            ) from None
        yield message
        # Not held here while the next is awaited: the stream's end leaves this frame in its
        # StopAsyncIteration's traceback, which lives until the garbage collector finds it.
        del message


def decode_named(
    received: Received[Any],
    *,
    device: torch.device | str = "cpu",
    max_bytes: int | None = None,
    reserve: Callable[[int], None] | None = None,
    owned: bool = False,
) -> dict[str, torch.Tensor]:
    """Decode every tensor of `received` by name; `max_bytes` caps their decoded total, and
    `reserve` is asked for the bytes that decoding allocates (a lossy codec's widened values;
    CODEC_NONE shares the payload's memory on the CPU).

    Both are checked before any tensor is decoded. See `swarm.wire.codec.decode` for the
    zero-copy caveat: results must not be modified in place, unless `owned`: then each is the
    caller's own (a chunked tensor's buffer as it is, an inline one copied out of its message),
    to keep and write to, without a copy of what came chunked.
    """
    _admit_named(received, max_bytes, reserve)
    return _decoded(received, device, owned)


async def decode_named_async(
    received: Received[Any],
    *,
    device: torch.device | str = "cpu",
    max_bytes: int | None = None,
    reserve: Callable[[int], None] | None = None,
    owned: bool = False,
) -> dict[str, torch.Tensor]:
    """`decode_named` for a caller on an event loop: checked and reserved there, and decoded on
    a thread where that is work (`OFF_LOOP_VALUES`), else in place."""
    _admit_named(received, max_bytes, reserve)
    if _widening(received.header.tensors) < OFF_LOOP_VALUES:
        return _decoded(received, device, owned)
    return await on_thread(functools.partial(_decoded, received, device, owned))


async def decode_async(msg: tensor_pb2.Tensor, *, max_bytes: int | None = None) -> torch.Tensor:
    """`swarm.wire.codec.decode` of one tensor on the CPU, for a caller on an event loop: on a
    thread where that is work (`OFF_LOOP_VALUES`), else in place."""
    if _widening([msg]) < OFF_LOOP_VALUES:
        return decode(msg, max_bytes=max_bytes)
    return await on_thread(functools.partial(decode, msg, max_bytes=max_bytes))


def _widening(tensors: Iterable[tensor_pb2.Tensor]) -> int:
    """The decoding work of `tensors`, in values of a cheap widening: a lossy codec's values,
    hadamard3's counted `HADAMARD_WEIGHT` times; nothing for CODEC_NONE (shared, no work)."""
    work = 0
    for t in tensors:
        if t.codec != CODEC_NONE:
            weight = HADAMARD_WEIGHT if t.codec == CODEC_HADAMARD3 else 1
            work += weight * math.prod(t.shape)
    return work


def _admit_named(
    received: Received[Any], max_bytes: int | None, reserve: Callable[[int], None] | None
) -> None:
    _check_count(received.header)
    tensors: list[tensor_pb2.Tensor] = list(received.header.tensors)
    counts = Counter(t.name for t in tensors)
    if len(counts) != len(tensors):
        dups = sorted(n for n, k in counts.items() if k > 1)
        shown = repr(dups) if len(dups) <= 10 else f"{repr(dups[:10])[:-1]}, ...]"
        many = f"{len(dups)} " if len(dups) > 10 else ""
        raise InvalidArgument(f"{many}duplicate tensor names: {shown}")
    if max_bytes is not None:
        total = sum(decoded_nbytes(t) for t in tensors)
        if total > max_bytes:
            raise ResourceExhausted(
                f"tensors decode to {total} bytes, above the limit of {max_bytes}"
            )
    if reserve is not None:
        reserve(sum(decoded_nbytes(t) for t in tensors if t.codec != CODEC_NONE))


def _decoded(
    received: Received[Any], device: torch.device | str, owned: bool
) -> dict[str, torch.Tensor]:
    decoded = {}
    for t, payload in zip(received.header.tensors, received.payloads, strict=True):
        tensor = decode(t, payload, device=device)
        shared = isinstance(payload, bytes) or (
            isinstance(payload, memoryview) and payload.readonly
        )
        if owned and shared and t.codec == CODEC_NONE and tensor.device.type == "cpu":
            tensor = tensor.clone()  # it shares a message's bytes
        decoded[t.name] = tensor
    return decoded


def grpc_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Options for every swarm gRPC server and channel: the message-size limits."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),  # a busy port must fail loudly, not be shared
    ]
