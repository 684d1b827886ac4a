"""A chunked message's body put back together (`chunking.receive` reads the stream).

What the header declares: each tensor's bytes inline, handed over on this host, or to follow in
chunks, and how many. Where each is written: the caller's own tensor (`Into`: a reply lands
where it is used), a handover's tensor (`Handed`), else a new `buffer`. Then each chunk is
checked against the header and copied once, into place: no per-chunk concatenation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from swarm.errors import ConfigError, InvalidArgument

__all__ = ["Body", "Handed", "Into", "buffer", "tensor_bytes"]

Into = Callable[[int, Any], "memoryview | None"]
"""`into(i, meta)`: where chunked tensor `i` (its header entry `meta`) is to be written, a
writable byte buffer of exactly `meta.nbytes`, or None for a new one."""


Handed = Callable[[int, Any], torch.Tensor]
"""`handed(i, meta)`: the payload of tensor `i`, handed over on this host (`meta.handover`),
`meta.nbytes` bytes as a uint8 tensor this process owns (`swarm.device.handover`)."""


def buffer(nbytes: int) -> memoryview:
    """A writable buffer of `nbytes` bytes, not zeroed (every byte is written before it is read)
    and backed by a torch tensor, so that a decoded tensor shares it (writable, no copy)."""
    return tensor_bytes(torch.empty(nbytes, dtype=torch.uint8))


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of `t` (contiguous, on the CPU) as a writable buffer: what is written there is
    written to `t`."""
    view: Any = t.reshape(-1).view(torch.uint8).numpy()
    return memoryview(view)


class Body:
    """One message's tensor payloads: declared by its header (nothing allocated yet, so its
    size can be checked first), then `place`d, then filled by its chunks (`take`)."""

    __slots__ = ("filled", "handed", "header", "inline", "payloads", "sizes", "to_come")

    def __init__(self, header: Any, handed: Handed | None) -> None:
        self.header = header
        self.handed = handed
        self.inline: list[bytes | None] = []  # a tensor's inline bytes; None: chunks follow
        self.sizes: list[int] = []  # each tensor's declared bytes
        for i, t in enumerate(header.tensors):
            data: bytes = t.data
            if t.HasField("handover") and (data or handed is None):
                raise InvalidArgument(f"tensor {i} ({t.name!r}): a handover is not taken here")
            if data:
                if t.nbytes not in (0, len(data)):
                    raise InvalidArgument(
                        f"tensor {i} ({t.name!r}): nbytes {t.nbytes} but {len(data)} inline bytes"
                    )
                self.inline.append(data)
                self.sizes.append(len(data))
            else:
                if t.nbytes < 0:
                    raise InvalidArgument(f"tensor {i} ({t.name!r}): negative nbytes {t.nbytes}")
                self.inline.append(None)
                self.sizes.append(t.nbytes)
        self.payloads: list[bytes | memoryview | torch.Tensor] = []
        self.filled: list[int] = []  # bytes of each tensor written so far
        self.to_come = 0  # bytes the chunks still carry, once placed

    def place(self, into: Into | None) -> None:
        """Give every tensor its payload: inline bytes as received, a handover's tensor (whole
        already), else where its chunks are written (`into`'s, or a new buffer)."""
        for i, (given, size) in enumerate(zip(self.inline, self.sizes, strict=True)):
            meta = self.header.tensors[i]
            if given is not None:
                self.payloads.append(given)
                continue
            if meta.HasField("handover"):
                assert self.handed is not None  # refused when declared otherwise
                self.payloads.append(self.handed(i, meta))
                self.inline[i] = b""  # complete: no chunk of it follows
                continue
            target = into(i, meta) if into is not None else None
            if target is None:
                target = buffer(size)
            elif target.readonly or target.nbytes != size:
                raise ConfigError(f"tensor {i}: a buffer of {target.nbytes} bytes for {size}")
            self.payloads.append(target.cast("B"))
        self.filled = [
            size if data is not None else 0
            for data, size in zip(self.inline, self.sizes, strict=True)
        ]
        self.to_come = sum(self.sizes) - sum(self.filled)

    def take(self, message: Any) -> int:
        """Copy one chunk message into place, after checking it fits the header; its bytes."""
        if len(message.tensors) or not message.HasField("chunk"):
            raise InvalidArgument("expected a chunk message after the header")
        # A chunk alone comes `Framed`, its data a view of what gRPC received.
        index: int = message.chunk.tensor
        piece: bytes | memoryview = message.chunk.data
        if index >= len(self.sizes):
            raise InvalidArgument(
                f"chunk for tensor {index}, but the header has {len(self.sizes)} tensors"
            )
        if self.inline[index] is not None:
            raise InvalidArgument(f"chunk for tensor {index}, whose data was inline")
        if self.filled[index] == self.sizes[index]:
            raise InvalidArgument(f"chunk for tensor {index}, which is already complete")
        if not piece:
            raise InvalidArgument(f"empty chunk for tensor {index}")
        end = self.filled[index] + len(piece)
        if end > self.sizes[index]:
            raise InvalidArgument(
                f"chunk overflows tensor {index}: {end} bytes of {self.sizes[index]} declared"
            )
        self.payloads[index][self.filled[index] : end] = piece  # type: ignore[index,assignment]
        self.filled[index] = end
        return len(piece)
