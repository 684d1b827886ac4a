"""A tensor's digest: what a push-plane replica commits to for each tensor it received and sent
(issue 55, `stage_server.replica.push_records`), and what the trainer checks the tensors it is
later given against. Of the tensor decoded, so a sender's and a receiver's agree whatever codec
and chunking carried it: its dtype, its shape and its bytes, on the host.

The bytes are hashed where they lie (a view of the tensor's own memory, no copy: issue 69, the
copy was a tenth of a digest's time), and hashlib lets go of the GIL while it hashes, so a digest
taken on a thread of its own runs beside the stage's compute (`push_records.PushRecords`)."""

from __future__ import annotations

import hashlib

import torch

__all__ = ["digest"]


def digest(tensor: torch.Tensor | None) -> bytes:
    """SHA-256 of `tensor`'s dtype, shape and bytes; b"" for none."""
    if tensor is None:
        return b""
    t = tensor.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)  # its memory, hashed in place
    return h.digest()
