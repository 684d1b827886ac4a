"""swarm.wire.codec: round trips for every dtype and codec, and every validation error."""

from __future__ import annotations

import gc
import math
import struct

import pytest
import torch

from swarm.errors import ConfigError, InvalidArgument, ResourceExhausted
from swarm.proto import tensor_pb2
from swarm.wire import hadamard
from swarm.wire.codec import (
    CODEC_BF16,
    CODEC_FP16,
    CODEC_HADAMARD3,
    CODEC_INT8_BLOCKWISE,
    CODEC_NONE,
    CODECS,
    DTYPES,
    codec_from_name,
    decode,
    decoded_nbytes,
    dtype_name,
    encode,
)

FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
ALL_CODECS = [CODEC_NONE, CODEC_FP16, CODEC_BF16, CODEC_INT8_BLOCKWISE, CODEC_HADAMARD3]
BLOCK = 256


def sample(dtype: torch.dtype, shape: tuple[int, ...] = (3, 1000), seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        # Spread magnitudes across blocks so that per-block scales matter.
        scale = torch.logspace(-3, 3, shape[-1] if shape else 1, dtype=torch.float64)
        return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)
    if dtype is torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype is torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=dtype)
    return torch.randint(-(2**30), 2**30, shape, generator=g, dtype=dtype)


def int8_reference_bound(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per element: its block's absmax / 254, the int8_blockwise rounding error bound."""
    flat = x.reshape(-1).to(torch.float64)
    n = flat.numel()
    bound = torch.empty(n, dtype=torch.float64)
    for start in range(0, n, block_size):
        block = flat[start : start + block_size]
        bound[start : start + block_size] = block.abs().max() / 254
    return bound.view(x.shape)


def check_round_trip(t: torch.Tensor, codec: int) -> None:
    msg = encode(t, "x", codec, block_size=BLOCK)
    assert msg.name == "x"
    assert msg.dtype == dtype_name(t.dtype)
    assert list(msg.shape) == list(t.shape)
    assert msg.nbytes == len(msg.data)
    out = decode(msg)
    assert out.dtype == t.dtype
    assert out.shape == t.shape
    assert out.device.type == "cpu"
    ref = t.detach().cpu()
    if not t.is_floating_point():
        assert msg.codec == CODEC_NONE  # lossy codecs are ignored for non-floating tensors
        assert torch.equal(out, ref)
        return
    assert msg.codec == codec
    n = t.numel()
    if codec == CODEC_NONE:
        assert len(msg.data) == n * t.element_size()
        assert torch.equal(out, ref)
    elif codec == CODEC_FP16:
        assert len(msg.data) == 2 * n
        assert torch.equal(out, ref.to(torch.float16).to(t.dtype))
    elif codec == CODEC_BF16:
        assert len(msg.data) == 2 * n
        assert torch.equal(out, ref.to(torch.bfloat16).to(t.dtype))
    elif codec == CODEC_HADAMARD3:
        blocks = math.ceil(n / hadamard.BLOCK)
        assert msg.block_size == hadamard.BLOCK
        assert len(msg.data) == 2 * blocks + blocks * hadamard.BLOCK * 3 // 8
        # 8 Gaussian levels: about 0.19 of each block's norm (more where a block is short).
        err = (out.to(torch.float64) - ref.to(torch.float64)).norm()
        assert float(err) <= 0.25 * float(ref.to(torch.float64).norm()) + 1e-30
    else:
        assert msg.block_size == BLOCK
        assert len(msg.data) == 4 * math.ceil(n / BLOCK) + n
        err = (out.to(torch.float64) - ref.to(torch.float64)).abs()
        bound = int8_reference_bound(ref, BLOCK)
        # Slack: float32 rounding of the scale and of the product, and the output dtype's own
        # rounding when it is narrower than float32.
        eps = torch.finfo(t.dtype).eps if t.element_size() < 4 else torch.finfo(torch.float32).eps
        slack = bound * 254 * 4 * eps + 1e-30
        assert bool((err <= bound + slack).all()), float((err - bound).max())


@pytest.mark.parametrize("codec", ALL_CODECS, ids=list(CODECS))
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_round_trip(dtype: torch.dtype, codec: int) -> None:
    check_round_trip(sample(dtype), codec)


@pytest.mark.parametrize("codec", ALL_CODECS, ids=list(CODECS))
def test_int8_error_is_within_block_bound_with_tail_block(codec: int) -> None:
    # 3000 values = 11 full blocks of 256 and a short tail of 184.
    t = sample(torch.float32, (3000,))
    check_round_trip(t, codec)


def test_int8_all_zero_block_decodes_to_zeros() -> None:
    t = torch.zeros(2 * BLOCK + 10)
    t[BLOCK : 2 * BLOCK] = torch.linspace(-5, 5, BLOCK)
    out = decode(encode(t, "x", CODEC_INT8_BLOCKWISE, block_size=BLOCK))
    assert torch.equal(out[:BLOCK], torch.zeros(BLOCK))
    assert torch.equal(out[2 * BLOCK :], torch.zeros(10))
    assert float(out[BLOCK:].abs().max()) == pytest.approx(5.0)
    # Scales are the absmax of each block.
    msg = encode(t, "x", CODEC_INT8_BLOCKWISE, block_size=BLOCK)
    scales = struct.unpack("<3f", msg.data[:12])
    assert scales == (0.0, 5.0, 0.0)


@pytest.mark.parametrize("codec", ALL_CODECS, ids=list(CODECS))
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_non_contiguous_inputs(dtype: torch.dtype, codec: int) -> None:
    base = sample(dtype, (40, 30))
    for t in (base.t(), base[::3, 1::2], base[:1].expand(5, 30)):
        assert not t.is_contiguous()
        check_round_trip(t, codec)


@pytest.mark.parametrize("codec", ALL_CODECS, ids=list(CODECS))
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("shape", [(0,), (3, 0, 5), ()], ids=["empty", "empty3d", "scalar"])
def test_zero_element_and_scalar(dtype: torch.dtype, codec: int, shape: tuple[int, ...]) -> None:
    t = sample(dtype, shape)
    check_round_trip(t, codec)
    if t.numel() == 0:
        assert len(encode(t, "x", codec).data) == 0


def test_requires_grad_tensor_is_detached() -> None:
    t = torch.randn(10, requires_grad=True)
    out = decode(encode(t * 2, "x"))
    assert not out.requires_grad
    assert torch.equal(out, (t * 2).detach())


def test_decode_none_is_zero_copy() -> None:
    t = torch.arange(8, dtype=torch.float32)
    msg = encode(t, "x")
    payload = bytearray(msg.data)
    out = decode(msg, payload)
    payload[0:4] = struct.pack("<f", 42.0)
    assert float(out[0]) == 42.0  # shares memory with the payload


def test_decode_keeps_payload_alive() -> None:
    t = torch.randn(1000, dtype=torch.float64)
    out = decode(encode(t, "x"))  # the payload is a temporary bytes object
    gc.collect()
    assert torch.equal(out, t)


def test_decode_uses_data_argument_over_msg_data() -> None:
    t = torch.arange(6, dtype=torch.int64).view(2, 3)
    msg = encode(t, "x")
    payload = msg.data
    msg.data = b""
    assert torch.equal(decode(msg, payload), t)
    assert torch.equal(decode(msg, memoryview(payload)), t)


def test_codec_from_name() -> None:
    assert codec_from_name("none") == CODEC_NONE
    assert codec_from_name("fp16") == CODEC_FP16
    assert codec_from_name("bf16") == CODEC_BF16
    assert codec_from_name("int8_blockwise") == CODEC_INT8_BLOCKWISE
    with pytest.raises(ConfigError, match="int8_blockwise") as info:
        codec_from_name("int4")
    assert "none" in str(info.value) and "int4" in str(info.value)


def test_dtype_name() -> None:
    for name, dtype in DTYPES.items():
        assert dtype_name(dtype) == name
    with pytest.raises(InvalidArgument, match="complex64"):
        dtype_name(torch.complex64)


def test_encode_rejects_unsupported_inputs() -> None:
    with pytest.raises(InvalidArgument, match="int16"):
        encode(torch.zeros(3, dtype=torch.int16), "x")
    with pytest.raises(InvalidArgument, match="codec"):
        encode(torch.zeros(3), "x", codec=99)
    with pytest.raises(ConfigError, match="block_size"):
        encode(torch.zeros(3), "x", CODEC_INT8_BLOCKWISE, block_size=0)


def make(dtype: str = "float32", shape: list[int] | None = None, **kw: object) -> tensor_pb2.Tensor:
    return tensor_pb2.Tensor(name="x", dtype=dtype, shape=[4] if shape is None else shape, **kw)


def test_decode_rejects_unknown_dtype() -> None:
    with pytest.raises(InvalidArgument, match="unknown dtype 'complex64'"):
        decode(make("complex64", data=b"\0" * 32))


def test_decode_rejects_unknown_codec() -> None:
    with pytest.raises(InvalidArgument, match="unknown codec 42"):
        decode(make(codec=42, data=b"\0" * 16))


def test_decode_rejects_lossy_codec_on_integer_dtype() -> None:
    with pytest.raises(InvalidArgument, match="floating"):
        decode(make("int64", codec=CODEC_FP16, data=b"\0" * 8))


def test_decode_rejects_an_empty_shape_whose_other_dimensions_overflow() -> None:
    # A zero dimension made the size 0, so every size check passed, and torch.empty then
    # raised RuntimeError (its strides overflow): INTERNAL, with an ERROR traceback.
    empty = tensor_pb2.Tensor(name="x", dtype="float32", shape=[0, 2**62, 2**62])
    with pytest.raises(InvalidArgument, match="dimension"):
        decode(empty)
    assert decode(make(shape=[0, 4], data=b"")).shape == (0, 4)


def test_decode_rejects_negative_dimension() -> None:
    with pytest.raises(InvalidArgument, match="negative"):
        decode(make(shape=[2, -2], data=b""))
    with pytest.raises(InvalidArgument, match="negative"):
        decoded_nbytes(make(shape=[-1]))


@pytest.mark.parametrize(
    ("codec", "expected"),
    [(CODEC_NONE, 16), (CODEC_FP16, 8), (CODEC_BF16, 8), (CODEC_INT8_BLOCKWISE, 8)],
    ids=list(CODECS)[:4],
)
@pytest.mark.parametrize("delta", [-1, 1])
def test_decode_rejects_wrong_payload_length(codec: int, expected: int, delta: int) -> None:
    # int8_blockwise, 4 values, block 4: one float32 scale + 4 int8 values = 8 bytes.
    msg = make(codec=codec, block_size=4, data=b"\0" * (expected + delta))
    with pytest.raises(InvalidArgument, match=f"expected {expected} .*got {expected + delta}"):
        decode(msg)
    # The exact length decodes.
    msg.data = b"\0" * expected
    assert torch.equal(decode(msg), torch.zeros(4))


def test_decode_rejects_int8_length_for_other_block_size() -> None:
    t = torch.randn(1000)
    msg = encode(t, "x", CODEC_INT8_BLOCKWISE, block_size=100)  # 10 scales
    msg.block_size = 64  # 16 scales: the payload no longer matches
    with pytest.raises(InvalidArgument, match=f"expected {16 * 4 + 1000} .*got {10 * 4 + 1000}"):
        decode(msg)


def test_decode_rejects_bad_block_size() -> None:
    with pytest.raises(InvalidArgument, match="block_size"):
        decode(make(codec=CODEC_INT8_BLOCKWISE, block_size=0, data=b"\0" * 8))
    with pytest.raises(InvalidArgument, match="block_size"):
        decode(make(codec=CODEC_INT8_BLOCKWISE, block_size=-4, data=b"\0" * 8))


def test_hadamard3_is_decoded_only_in_the_block_every_encoder_sends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A header's own block (a power of two up to 65536) made one value's tensor 65536 values of
    rotation: 64 such in a message, ~0.6 s of a receiver's event loop, which decides to decode
    off it by the values a header says (1 each). The wire has one block: any other is refused
    before any decoding."""
    decoded: list[int] = []
    real = hadamard.decode
    monkeypatch.setattr(hadamard, "decode", lambda *a: decoded.append(a[2]) or real(*a))
    big = 1 << 16
    msg = make(shape=[1], codec=CODEC_HADAMARD3, block_size=big)
    msg.data = b"\0" * hadamard.payload_bytes(1, big)
    with pytest.raises(InvalidArgument, match=f"block_size {hadamard.BLOCK}, got {big}"):
        decode(msg)
    assert decoded == []
    ok = encode(torch.randn(1), "x", CODEC_HADAMARD3)
    assert ok.block_size == hadamard.BLOCK and decode(ok).shape == (1,)
    assert decoded == [hadamard.BLOCK]


def test_hadamard3_sends_ten_times_fewer_bytes_and_keeps_what_an_outlier_hides() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1024, generator=g)
    msg = encode(x, "x", CODEC_HADAMARD3)
    assert x.numel() * 4 / len(msg.data) > 10.0
    assert float((decode(msg) - x).norm() / x.norm()) < 0.2  # Gaussian: about 0.19
    x[:, 7] *= 100.0  # one outlier channel, as activations have
    out = decode(encode(x, "x", CODEC_HADAMARD3))
    assert float((out - x).norm() / x.norm()) < 0.25
    # 3 bits scaled to an outlier 100x the rest would send the rest as zeros; rotated, the
    # rest still comes through (its error is spread, not its signal lost).
    rest, rest_out = torch.cat([x[:, :7], x[:, 8:]], 1), torch.cat([out[:, :7], out[:, 8:]], 1)
    cosine = torch.nn.functional.cosine_similarity(rest.reshape(-1), rest_out.reshape(-1), dim=0)
    assert float(cosine) > 0.7


def test_hadamard3_rejects_a_bad_block_or_payload() -> None:
    msg = encode(torch.randn(300), "x", CODEC_HADAMARD3)  # 2 blocks: 4 + 192 bytes
    assert len(msg.data) == 196
    for block in (0, 12, 4, 128, 512, 1 << 17):  # powers of two too: the wire has one block
        bad = tensor_pb2.Tensor()
        bad.CopyFrom(msg)
        bad.block_size = block
        with pytest.raises(InvalidArgument, match=f"block_size {hadamard.BLOCK}, got {block}$"):
            decode(bad)
    msg.data = msg.data[:-1]
    with pytest.raises(InvalidArgument, match=r"expected 196 .*got 195"):
        decode(msg)


def test_decode_rejects_bool_bytes_other_than_0_or_1() -> None:
    with pytest.raises(InvalidArgument, match="bool"):
        decode(make("bool", data=b"\0\1\2\0"))
    assert decode(make("bool", data=b"\0\1\1\0")).tolist() == [False, True, True, False]


def test_max_bytes_enforced_before_allocation() -> None:
    # A hostile header: 4 TB of float32 with a tiny payload. Must not try to allocate.
    msg = make(shape=[10**12], data=b"\0" * 16)
    with pytest.raises(ResourceExhausted, match=str(4 * 10**12)):
        decode(msg, max_bytes=1 << 30)
    huge = make(shape=[10**12, 10**12], codec=CODEC_INT8_BLOCKWISE, block_size=16, data=b"")
    with pytest.raises(ResourceExhausted):
        decode(huge, max_bytes=1 << 30)
    # Without a limit, the payload length check still refuses before allocating.
    with pytest.raises(InvalidArgument, match="expected"):
        decode(msg)


def test_max_bytes_counts_decoded_not_wire_size() -> None:
    t = torch.randn(100, dtype=torch.float64)
    msg = encode(t, "x", CODEC_FP16)  # 200 wire bytes, 800 decoded
    assert decoded_nbytes(msg) == 800
    assert torch.equal(decode(msg, max_bytes=800), t.half().double())
    with pytest.raises(ResourceExhausted, match="800 bytes, above the limit of 799"):
        decode(msg, max_bytes=799)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("codec", ALL_CODECS, ids=list(CODECS))
def test_cuda_round_trip(codec: int) -> None:
    t = sample(torch.float32, (3000,)).cuda()
    msg = encode(t, "x", codec, block_size=BLOCK)
    out = decode(msg, device="cuda")
    assert out.device.type == "cuda"
    cpu = decode(msg)
    assert torch.allclose(out.cpu(), cpu, rtol=1e-6, atol=0)
