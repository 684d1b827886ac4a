"""How the generated stubs turn streamed messages into gRPC bytes and back: a chunk's bytes are
copied once each way, not five times.

Every streamed message type carries bulk bytes in `chunk` (`Chunk { uint32 tensor = 1; bytes data
= 2; }`, `swarm.wire.chunking`). Through protobuf a chunk of 4 MiB is copied into a Python
`bytes`, into the message, into an encoder's growing buffer (twice its size), into the serialized
`bytes`, and by gRPC into its own buffer; on the way in, out of gRPC, into the parsed message and
into a `bytes` again when `.data` is read. On a stage of tens of millions of parameters those
copies are most of what averaging and state transfer cost, and their churn is most of a
replica's memory beyond its state (docs/bulk.md).

So a chunk travels as a `Framed` chunk: its protobuf encoding written by hand in one copy (the
same bytes protobuf would write, so any protobuf reader parses it), handed to gRPC as it is; and
on the way in a message that is exactly one chunk is read as a `Framed` whose `data` is a view of
the bytes gRPC gave (no copy). Anything else, or anything that does not parse cleanly, goes
through protobuf as before, which refuses what is malformed.

Any other message of a streamed type (a header) is measured before protobuf parses it: protobuf
builds every tensor and value a message names, so a 63 MiB header could name millions, costing
gigabytes and seconds of the event loop before the tensor cap was ever checked. A header of more
than MAX_TENSORS_PER_MESSAGE tensors or MAX_HEADER_VALUES values (fields and packed elements,
nested ones included) is refused from a walk of its encoding that builds nothing: the deserializer
returns a `HeaderRefused` in its place (gRPC's client swallows a deserializer's exception, its
stream yielding None; a value keeps the reason), which `swarm.wire.chunking` raises as the
sender's InvalidArgument. A header of no more bytes than MAX_HEADER_VALUES, of a type nested no
deeper than the walk allows, can break neither of those bounds (every value takes a byte of its
encoding at least): its walk counts its tensors alone, without descending into its nested
messages, which is all it could refuse it for (issue 69: every push's header is walked on the
event loop that relays the next).

protogen.py makes every generated stub and servicer use `serialize` and `deserializer(cls)`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

from google.protobuf.descriptor import FieldDescriptor

__all__ = [
    "MAX_HEADER_VALUES",
    "MAX_TENSORS_PER_MESSAGE",
    "Framed",
    "HeaderRefused",
    "deserializer",
    "frame",
    "serialize",
]

# Every sender puts one to three tensors in a message (a request's inputs, targets or gradient; a
# reply's one tensor; a state's or an update's one tensor a message): more is refused from the
# header, before a tensor of it is built (a 64 MiB message could name thirty million).
MAX_TENSORS_PER_MESSAGE = 64
# Values a header may hold, nested ones included: its own fields, its tensors' (a shape's
# dimensions each), its routes' peers. An honest header holds a few hundred.
MAX_HEADER_VALUES = 1 << 16
_MAX_DEPTH = 16  # nested messages; swarm's go three deep


class HeaderRefused(ValueError):
    """A header refused before it was parsed, returned in its place by `deserializer`;
    `swarm.wire.chunking` raises it as the sender's InvalidArgument (this floor knows no swarm
    errors)."""


_CHUNK_TENSOR_KEY = (1 << 3) | 0  # Chunk.tensor: field 1, varint
_CHUNK_DATA_KEY = (2 << 3) | 2  # Chunk.data: field 2, length-delimited
_MAX_UINT32 = (1 << 32) - 1


class Framed:
    """One chunk of a streamed message (`chunk.tensor`, `chunk.data`, no other field), as it is
    written to or read from gRPC. It reads like the message it stands for where chunked streams
    read one (`tensors`, `chunk`, `HasField`), so `swarm.wire.chunking` and tests treat both alike.
    """

    __slots__ = ("data", "encoded", "tensor")
    tensors: tuple[()] = ()

    def __init__(self, tensor: int, data: memoryview | bytes, encoded: bytes | None = None):
        self.tensor, self.data, self.encoded = tensor, data, encoded

    @property
    def chunk(self) -> Framed:
        return self

    def HasField(self, name: str) -> bool:
        return name == "chunk"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Framed):
            return NotImplemented
        return self.tensor == other.tensor and self.data == other.data

    __hash__ = None  # type: ignore[assignment]  (mutable views, as messages are unhashable)

    def SerializeToString(self) -> bytes:
        if self.encoded is None:
            raise ValueError("a received chunk has no encoding of its own")
        return self.encoded


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        if not value:
            out.append(low)
            return bytes(out)
        out.append(low | 0x80)


def frame(cls: Any, tensor: int, data: memoryview | bytes) -> Framed:
    """A message of type `cls` carrying only `chunk { tensor, data }`, encoded with one copy of
    `data` (which may be a view of a tensor's memory: it is copied here, not when sent)."""
    field = _chunk_field(cls)
    if field is None:
        raise ValueError(f"{cls.__name__} has no 'chunk' field")
    size = memoryview(data).nbytes
    # As protobuf writes it: proto3 leaves out a field at its default (tensor 0).
    index = _varint(_CHUNK_TENSOR_KEY) + _varint(tensor) if tensor else b""
    inner = index + _varint(_CHUNK_DATA_KEY) + _varint(size)
    head = _varint((field << 3) | 2) + _varint(len(inner) + size) + inner
    encoded = b"".join((head, data))
    return Framed(tensor, memoryview(encoded)[len(head) :], encoded)


def serialize(message: Any) -> bytes:
    """A gRPC request or response serializer for every message type: a `Framed` chunk as it was
    encoded, any other message through protobuf."""
    if isinstance(message, Framed):
        return message.SerializeToString()
    data: bytes = message.SerializeToString()
    return data


@functools.cache  # a stub is made per call in places (a pool's channels): built once a type
def deserializer(cls: Any) -> Callable[[bytes], Any]:
    """A gRPC deserializer for messages of type `cls`: a message that is one chunk alone becomes
    a `Framed` viewing the received bytes; anything else is `cls.FromString`."""
    field = _chunk_field(cls)
    parse: Callable[[bytes], Any] = cls.FromString
    if field is None:
        return parse
    outer_key = (field << 3) | 2

    tensors = cls.DESCRIPTOR.fields_by_name.get("tensors")
    tensors_field = int(tensors.number) if tensors is not None else -1

    def deserialize(data: bytes) -> Any:
        chunk = _read_chunk(data, outer_key)
        if chunk is not None:
            return chunk
        try:
            _check_header(data, cls.DESCRIPTOR, tensors_field)  # before protobuf builds any
        except HeaderRefused as refused:
            return refused
        return parse(data)

    return deserialize


def _chunk_field(cls: Any) -> int | None:
    field = cls.DESCRIPTOR.fields_by_name.get("chunk")
    if field is None or field.message_type is None:
        return None
    return int(field.number) if field.message_type.full_name == "swarm.proto.Chunk" else None


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """The varint at `pos` and the position after it; (-1, pos) if it is cut off or too long."""
    value = shift = 0
    for i in range(pos, min(pos + 10, len(data))):
        byte = data[i]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i + 1
        shift += 7
    return -1, pos


def _read_chunk(data: bytes, outer_key: int) -> Framed | None:
    """`data` as a `Framed` if it is exactly one `chunk` field holding a tensor index and a
    non-empty data field, each once; else None (protobuf reads it, and judges it)."""
    key, pos = _read_varint(data, 0)
    if key != outer_key:
        return None
    length, pos = _read_varint(data, pos)
    if length < 0 or pos + length != len(data):
        return None
    tensor, payload = 0, None
    seen_tensor = False
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        if key == _CHUNK_TENSOR_KEY and not seen_tensor:
            tensor, pos = _read_varint(data, pos)
            if not 0 <= tensor <= _MAX_UINT32:
                return None
            seen_tensor = True
        elif key == _CHUNK_DATA_KEY and payload is None:
            size, pos = _read_varint(data, pos)
            if size <= 0 or pos + size > len(data):
                return None
            payload = memoryview(data)[pos : pos + size]
            pos += size
        else:
            return None
    if payload is None:
        return None
    return Framed(tensor, payload)


_FIXED_SIZE = {1: 8, 5: 4}  # wire type: bytes a value
# A packed repeated field's bytes a value, by its type; varints take at least one.
_PACKED_SIZE = {
    FieldDescriptor.TYPE_DOUBLE: 8,
    FieldDescriptor.TYPE_FIXED64: 8,
    FieldDescriptor.TYPE_SFIXED64: 8,
    FieldDescriptor.TYPE_FLOAT: 4,
    FieldDescriptor.TYPE_FIXED32: 4,
    FieldDescriptor.TYPE_SFIXED32: 4,
}


class _Header:
    """The walk of one header's encoding: counts its values and tensors, refuses past the caps.
    What is malformed is left to protobuf, which refuses it no later than the walk stopped."""

    def __init__(self, data: bytes, tensors_field: int, shallow: bool = False) -> None:
        self.data, self.tensors_field = data, tensors_field
        self.values = self.tensors = 0
        self.shallow = shallow  # nested messages not walked: they can refuse nothing

    def walk(self, start: int, end: int, desc: Any, depth: int) -> None:
        if depth > _MAX_DEPTH:
            raise HeaderRefused(f"a message nested more than {_MAX_DEPTH} deep")
        pos = start
        while pos < end:
            key, pos = _read_varint(self.data, pos)
            wire = key & 7
            if key < 0 or wire not in (0, 1, 2, 5):
                return  # cut off, a group, or no wire type at all: protobuf judges it
            values = 1
            if wire == 0:
                _, pos = _read_varint(self.data, pos)
                if pos < 0:
                    return
            elif wire == 2:
                length, pos = _read_varint(self.data, pos)
                if length < 0 or pos + length > end:
                    return
                field = desc.fields_by_number.get(key >> 3)
                values = self._delimited(pos, pos + length, field, depth)
                pos += length
            else:
                pos += _FIXED_SIZE[wire]
            self.values += values
            if self.values > MAX_HEADER_VALUES:
                self.refuse_tensors("more than ")
                raise HeaderRefused(
                    f"a message of more than {MAX_HEADER_VALUES} values (MAX_HEADER_VALUES), "
                    "refused before it was parsed"
                )

    def refuse_tensors(self, more_than: str = "") -> None:
        if self.tensors > MAX_TENSORS_PER_MESSAGE:
            raise HeaderRefused(
                f"a message of {more_than}{self.tensors} tensors, more than "
                f"{MAX_TENSORS_PER_MESSAGE} a message (MAX_TENSORS_PER_MESSAGE), refused before "
                "it was parsed"
            )

    def _delimited(self, start: int, end: int, field: Any, depth: int) -> int:
        """The values of one length-delimited field, a nested message's walked and counted."""
        if field is None or field.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES):
            return 1  # bytes (an unknown field's too: protobuf keeps those unparsed)
        if field.message_type is None:  # a packed repeated scalar
            return max(1, (end - start) // _PACKED_SIZE.get(field.type, 1))
        if depth == 0 and field.number == self.tensors_field:
            self.tensors += 1
            if self.tensors > MAX_TENSORS_PER_MESSAGE:
                return 1  # refused once counted (the refusal says how many): not walked
        if not self.shallow:
            self.walk(start, end, field.message_type, depth + 1)
        return 1


def _check_header(data: bytes, descriptor: Any, tensors_field: int) -> None:
    """HeaderRefused when the message `data` encodes (of type `descriptor`) names more than
    MAX_TENSORS_PER_MESSAGE tensors or MAX_HEADER_VALUES values."""
    # Each value the walk counts takes at least one byte of `data`, and it descends no deeper
    # than the type's nesting: where neither bound can be passed, its tensors are all it counts.
    shallow = len(data) <= MAX_HEADER_VALUES and _nesting(descriptor) <= _MAX_DEPTH
    header = _Header(data, tensors_field, shallow)
    header.walk(0, len(data), descriptor, 0)
    header.refuse_tensors()


@functools.cache
def _nesting(descriptor: Any) -> float:
    """How deep the walk can descend into a message of type `descriptor` (through the fields
    it knows): infinite where the type holds itself, at any depth."""
    return _nested(descriptor, frozenset())


def _nested(descriptor: Any, within: frozenset[str]) -> float:
    if descriptor.full_name in within:
        return math.inf
    within = within | {descriptor.full_name}
    inner = [f.message_type for f in descriptor.fields if f.message_type is not None]
    return max((1 + _nested(d, within) for d in inner), default=0)
