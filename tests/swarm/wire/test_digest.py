"""`swarm.wire.digest`: a push-plane commitment's digest. It is compared across peers (a sender's
against its receiver's, a record's against its commitment), so its value is fixed: SHA-256 of
"dtype|shape|" and the tensor's bytes, however the tensor lies in memory. Hashed in place since
issue 69 (no copy of the bytes first); these pin the value the copying form gave."""

from __future__ import annotations

import hashlib

import pytest
import torch

from swarm.wire.digest import digest


def copied(t: torch.Tensor) -> bytes:
    """The digest as it was first written: the bytes copied out, then hashed."""
    t = t.detach().contiguous()
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.digest()


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(8, 16, 32),
        torch.randn(8, 16, dtype=torch.float64),
        torch.randn(4, 64).to(torch.bfloat16),
        torch.randn(4, 64).to(torch.float16),
        torch.randint(0, 256, (8, 128)),
        torch.randint(0, 255, (3, 5), dtype=torch.uint8),
        torch.tensor(2.5, dtype=torch.float64),  # a loss: no dimensions
        torch.zeros(0, 4),  # no elements
        torch.randn(16, 8).t(),  # not contiguous: its values in order, not its storage's
        torch.randn(4, 8, requires_grad=True),
    ],
    ids=["f32", "f64", "bf16", "f16", "i64", "u8", "scalar", "empty", "transposed", "grad"],
)
def test_the_digest_is_the_copying_forms(tensor: torch.Tensor) -> None:
    assert digest(tensor) == copied(tensor)


def test_a_digest_tells_dtype_shape_and_every_byte_apart() -> None:
    x = torch.arange(12, dtype=torch.float32)
    assert digest(x) != digest(x.reshape(3, 4)) != digest(x.to(torch.float64))
    y = x.clone()
    y.view(torch.uint8)[-1] ^= 1  # one bit of the last value
    assert digest(x) != digest(y)
    assert digest(None) == b""
