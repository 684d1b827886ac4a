"""Tensors to and from `swarm.proto.Tensor` messages.

`encode` turns a torch tensor into a message whose `data` holds the (possibly compressed) bytes;
`decode` validates a message against its payload and rebuilds the tensor. Every check that guards
memory (`max_bytes`, payload length) runs before anything is allocated, so a hostile header cannot
make a server allocate more than the configured limit.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import cast

import torch

from swarm.errors import ConfigError, InvalidArgument, ResourceExhausted
from swarm.proto import tensor_pb2
from swarm.wire import hadamard

__all__ = [
    "CODECS",
    "CODEC_BF16",
    "CODEC_FP16",
    "CODEC_HADAMARD3",
    "CODEC_INT8_BLOCKWISE",
    "CODEC_NONE",
    "DTYPES",
    "HostCopy",
    "codec_from_name",
    "decode",
    "decoded_nbytes",
    "decoded_values",
    "dtype_name",
    "encode",
    "encode_payload",
    "expected_payload",
]

CODEC_NONE: int = tensor_pb2.CODEC_NONE
CODEC_FP16: int = tensor_pb2.CODEC_FP16
CODEC_BF16: int = tensor_pb2.CODEC_BF16
CODEC_INT8_BLOCKWISE: int = tensor_pb2.CODEC_INT8_BLOCKWISE
CODEC_HADAMARD3: int = tensor_pb2.CODEC_HADAMARD3

CODECS: dict[str, int] = {
    "none": CODEC_NONE,
    "fp16": CODEC_FP16,
    "bf16": CODEC_BF16,
    "int8_blockwise": CODEC_INT8_BLOCKWISE,
    "hadamard3": CODEC_HADAMARD3,
}
_CODEC_NAMES: dict[int, str] = {v: k for k, v in CODECS.items()}

# Lossy casts: the wire dtype each codec sends floating tensors as.
_CAST_CODECS: dict[int, torch.dtype] = {CODEC_FP16: torch.float16, CODEC_BF16: torch.bfloat16}

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

_BUFFER_WARNING = "The given buffer is not writable"
_MAX_BLOCK_SIZE = 2**31 - 1  # Tensor.block_size is an int32

Buffer = bytes | bytearray | memoryview
# A payload handed over (`swarm.device.handover`) comes as a 1-D uint8 tensor, on its device.
Payload = Buffer | torch.Tensor
# A tensor's bytes on the host for as long as the context is open
# (`swarm.device.host_copies`: through a reusable pinned buffer on CUDA). The default copies
# with `.cpu()`.
HostCopy = Callable[[torch.Tensor], AbstractContextManager[torch.Tensor]]


# The most elements an empty tensor's other dimensions may describe (2^50: no tensor is near
# it; torch.empty's int64 strides overflow past 2^63). A tensor with elements is held to the
# payload it came with, and to `max_bytes`, instead.
MAX_ELEMENTS = 1 << 50


def _cpu(t: torch.Tensor) -> AbstractContextManager[torch.Tensor]:
    return nullcontext(t.cpu())


def codec_from_name(name: str) -> int:
    """The `Codec` enum value for a config name such as "int8_blockwise"."""
    try:
        return CODECS[name]
    except KeyError:
        raise ConfigError(f"unknown codec {name!r}; allowed: {', '.join(CODECS)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of `dtype` ("float32", ...); InvalidArgument for dtypes the wire lacks."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise InvalidArgument(
            f"dtype {dtype} cannot be sent; allowed: {', '.join(DTYPES)}"
        ) from None


def encode(
    t: torch.Tensor,
    name: str,
    codec: int = CODEC_NONE,
    block_size: int = 2048,
    *,
    host: HostCopy = _cpu,
) -> tensor_pb2.Tensor:
    """Encode `t` as a `Tensor` message named `name`.

    Lossy codecs apply to floating tensors only; others always go as CODEC_NONE. The cast or
    quantization runs on `t`'s device before the copy to the CPU, so fewer bytes cross the bus.
    int8_blockwise and hadamard3 do not preserve NaN or infinity; hadamard3 uses its own
    block (`swarm.wire.hadamard.BLOCK`), not `block_size`. `host` copies the wire form to the
    host: it blocks until the device has produced `t`, so a server calls this off its event loop.
    """
    msg, wire = encode_payload(t, name, codec, block_size)
    with host(wire) as on_host:
        # The one unavoidable copy: protobuf bytes fields take `bytes` only.
        msg.data = on_host.numpy().tobytes()
    return msg


def encode_payload(
    t: torch.Tensor, name: str, codec: int = CODEC_NONE, block_size: int = 2048
) -> tuple[tensor_pb2.Tensor, torch.Tensor]:
    """`encode`'s message without its `data`, and the encoded bytes (1-D uint8, on `t`'s
    device) that go there, or are handed over instead (`swarm.device.handover`)."""
    name_of_dtype = dtype_name(t.dtype)
    if codec not in _CODEC_NAMES:
        raise InvalidArgument(f"unknown codec {codec}; allowed: {sorted(_CODEC_NAMES)}")
    if not t.is_floating_point():
        codec = CODEC_NONE
    t = t.detach()
    msg = tensor_pb2.Tensor(
        name=name, dtype=name_of_dtype, shape=t.shape, codec=cast(tensor_pb2.Codec, codec)
    )
    if codec == CODEC_INT8_BLOCKWISE:
        if not 0 < block_size <= _MAX_BLOCK_SIZE:
            raise ConfigError(f"block_size must be in 1..{_MAX_BLOCK_SIZE}, got {block_size}")
        wire = _quantize(t, block_size)
        msg.block_size = block_size
    elif codec == CODEC_HADAMARD3:
        wire = hadamard.encode(t, hadamard.BLOCK)
        msg.block_size = hadamard.BLOCK
    else:
        wire = t.to(_CAST_CODECS[codec]) if codec in _CAST_CODECS else t
    # reshape(-1) first: a 0-dim tensor cannot be viewed as a dtype of another element size.
    # On the device: the copy to the host then moves one flat run of bytes.
    wire = wire.contiguous().reshape(-1).view(torch.uint8)
    msg.nbytes = wire.numel()
    return msg, wire


def _quantize(t: torch.Tensor, block_size: int) -> torch.Tensor:
    """Pack `t` as float32 absmax per block followed by int8 values, as one uint8 tensor."""
    flat = t.reshape(-1).to(torch.float32)
    n = flat.numel()
    nb_full, tail = divmod(n, block_size)
    nblocks = nb_full + (1 if tail else 0)
    out = torch.empty(4 * nblocks + n, dtype=torch.uint8, device=t.device)
    scales = out[: 4 * nblocks].view(torch.float32)
    q = out[4 * nblocks :].view(torch.int8)
    n_full = nb_full * block_size
    # Full blocks as a 2-D view, the short last block separately: no padding copy.
    if nb_full:
        _quantize_blocks(
            flat[:n_full].view(nb_full, block_size),
            scales[:nb_full],
            q[:n_full].view(nb_full, block_size),
        )
    if tail:
        _quantize_blocks(flat[n_full:].view(1, tail), scales[nb_full:], q[n_full:].view(1, tail))
    return out


def _quantize_blocks(blocks: torch.Tensor, scales: torch.Tensor, q: torch.Tensor) -> None:
    # vector_norm(inf) is max(|x|) without materializing |x|.
    absmax = torch.linalg.vector_norm(blocks, ord=math.inf, dim=1)
    scales.copy_(absmax)
    inv = torch.where(absmax > 0, 127.0 / absmax, torch.zeros_like(absmax))
    q.copy_((blocks * inv[:, None]).round_().clamp_(-127, 127))


def _numel(msg: tensor_pb2.Tensor) -> int:
    for d in msg.shape:
        if d < 0:
            raise InvalidArgument(
                f"tensor {msg.name!r} has a negative dimension: {list(msg.shape)}"
            )
    # An empty tensor's other dimensions are held to what a tensor could hold too: with a 0
    # among them every size check passes (its size is 0), and torch.empty's strides overflow.
    if 0 in msg.shape and math.prod(d or 1 for d in msg.shape) > MAX_ELEMENTS:
        raise InvalidArgument(
            f"tensor {msg.name!r} has dimensions past {MAX_ELEMENTS} elements: {list(msg.shape)}"
        )
    return math.prod(msg.shape)  # Python ints: a hostile shape cannot overflow


def _dtype(msg: tensor_pb2.Tensor) -> torch.dtype:
    try:
        return DTYPES[msg.dtype]
    except KeyError:
        raise InvalidArgument(
            f"tensor {msg.name!r} has unknown dtype {msg.dtype!r}; allowed: {', '.join(DTYPES)}"
        ) from None


def decoded_values(msg: tensor_pb2.Tensor) -> int:
    """How many values the decoded tensor holds; validates its shape."""
    return _numel(msg)


def decoded_nbytes(msg: tensor_pb2.Tensor) -> int:
    """Bytes the decoded tensor will occupy (numel * itemsize); validates dtype and shape."""
    return _numel(msg) * _dtype(msg).itemsize


def expected_payload(msg: tensor_pb2.Tensor) -> int:
    """The encoded bytes `msg`'s header says its payload has (validating dtype, shape, codec)."""
    dtype, numel, codec = _dtype(msg), _numel(msg), msg.codec
    if codec not in _CODEC_NAMES:
        raise InvalidArgument(f"tensor {msg.name!r} has unknown codec {codec}")
    if codec != CODEC_NONE and not dtype.is_floating_point:
        raise InvalidArgument(
            f"tensor {msg.name!r}: codec {_CODEC_NAMES[codec]} applies to floating dtypes only, "
            f"got {msg.dtype}"
        )
    if codec in _CAST_CODECS:
        return numel * _CAST_CODECS[codec].itemsize
    if codec == CODEC_INT8_BLOCKWISE:
        if msg.block_size <= 0:
            raise InvalidArgument(
                f"tensor {msg.name!r}: int8_blockwise needs block_size > 0, got {msg.block_size}"
            )
        return 4 * -(-numel // msg.block_size) + numel
    if codec == CODEC_HADAMARD3:
        # One block on the wire: a header's own (up to 65536) would pad each tensor to it, and
        # a receiver decides to decode off its event loop by the values a header says
        if msg.block_size != hadamard.BLOCK:
            raise InvalidArgument(
                f"tensor {msg.name!r}: hadamard3 is sent in block_size {hadamard.BLOCK}, "
                f"got {msg.block_size}"
            )
        return hadamard.payload_bytes(numel, msg.block_size)
    return numel * dtype.itemsize


def _frombuffer(buf: memoryview, dtype: torch.dtype, count: int, offset: int = 0) -> torch.Tensor:
    with warnings.catch_warnings():
        # Read-only payloads (bytes) are fine: the result is documented as not to be modified.
        warnings.filterwarnings("ignore", message=_BUFFER_WARNING, category=UserWarning)
        return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset)


def decode(
    msg: tensor_pb2.Tensor,
    data: Payload | None = None,
    *,
    device: torch.device | str = "cpu",
    max_bytes: int | None = None,
) -> torch.Tensor:
    """Rebuild the tensor `msg` describes, on `device`.

    `data` is the assembled payload of a chunked tensor, or a handed-over one (a uint8 tensor,
    decoded where it is: `device` is then its device); without it `msg.data` is used. For
    CODEC_NONE on the CPU the result shares memory with the payload (no copy): it must not be
    modified in place (clone it first), and it may be read-only when the payload is `bytes`.

    Raises InvalidArgument for an unknown dtype or codec, a negative dimension or a payload whose
    length does not match shape, codec and block size; ResourceExhausted when the decoded tensor
    would exceed `max_bytes`, before anything is allocated.
    """
    dtype = _dtype(msg)
    numel = _numel(msg)
    size = numel * dtype.itemsize
    if max_bytes is not None and size > max_bytes:
        raise ResourceExhausted(
            f"tensor {msg.name!r} decodes to {size} bytes, above the limit of {max_bytes}"
        )
    expected = expected_payload(msg)
    if isinstance(data, torch.Tensor):
        raw, device = data.reshape(-1).view(torch.uint8), data.device
    else:
        buf = memoryview(msg.data if data is None else data).cast("B")
        # torch.frombuffer refuses empty buffers.
        raw = (
            _frombuffer(buf, torch.uint8, len(buf))
            if len(buf)
            else torch.empty(0, dtype=torch.uint8)
        )
    if raw.numel() != expected:
        raise InvalidArgument(
            f"tensor {msg.name!r} ({msg.dtype}{list(msg.shape)}, codec "
            f"{_CODEC_NAMES[msg.codec]}): expected {expected} payload bytes, got {raw.numel()}"
        )
    shape = tuple(msg.shape)
    if numel == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    codec = msg.codec
    if codec == CODEC_NONE:
        if dtype is torch.bool and int(raw.max()) > 1:
            raise InvalidArgument(f"tensor {msg.name!r}: bool payload has bytes other than 0/1")
        return raw.view(dtype).view(shape).to(device)
    if codec in _CAST_CODECS:
        # Move the compact wire form first, then widen on the target device.
        return raw.view(_CAST_CODECS[codec]).to(device).to(dtype).view(shape)
    if codec == CODEC_HADAMARD3:
        return hadamard.decode(raw.to(device), numel, msg.block_size).view(shape).to(dtype)
    return _dequantize(raw, numel, msg.block_size, device).view(shape).to(dtype)


def _dequantize(
    raw: torch.Tensor, numel: int, block_size: int, device: torch.device | str
) -> torch.Tensor:
    nb_full, tail = divmod(numel, block_size)
    nblocks = nb_full + (1 if tail else 0)
    scales = raw[: 4 * nblocks].view(torch.float32).to(device) / 127.0
    q = raw[4 * nblocks :].view(torch.int8).to(device)
    out = torch.empty(numel, dtype=torch.float32, device=scales.device)
    n_full = nb_full * block_size
    if nb_full:
        torch.mul(
            q[:n_full].view(nb_full, block_size),
            scales[:nb_full, None],
            out=out[:n_full].view(nb_full, block_size),
        )
    if tail:
        torch.mul(q[n_full:], scales[nb_full], out=out[n_full:])
    return out
