"""Device memory crossing to and from the host a chunk at a time: a CUDA gradient's parts sent in
an averaging round and their sums landing back in it, a snapshot's tensors streamed to a joiner.
Every such copy runs off the event loop (`OffLoop`), which only ever sees host bytes: a busy
device holds a copying thread, never the loop that moves every other call's bytes.

Nothing here copies a whole gradient or state: a tensor on a device is sent chunk by chunk, each
chunk copied into one of a few reusable host buffers (pinned on CUDA, so the copy runs at the
link's speed) and framed from there (`swarm.proto.framing.frame` copies it into the message, so
the buffer is free again at once); a sum comes back into host memory of one slice and goes to
its place in the device tensor chunk by chunk. The host memory a round or a download stages is
thus `buffers` chunks plus the slices in flight, whatever the stage's size.

`ChunkCopies` is the seam every such copy goes through (a chunk into or out of a buffer it is
given: not `swarm.device.host_copies.HostCopies`, which lends its own): `TorchChunkCopies` on a
real device; a test's counting fake treats CPU tensors as a device's and measures what crosses
(no GPU needed).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar

import torch
from google.protobuf.message import Message

from swarm.errors import ConfigError
from swarm.proto import framing
from swarm.wire import chunking as wire

__all__ = ["BUFFERS", "ChunkCopies", "OffLoop", "Staging", "TorchChunkCopies", "staging"]

M = TypeVar("M", bound=Message)
T = TypeVar("T")

BUFFERS = 2  # host buffers of one chunk each: one filled while the last one is framed


class ChunkCopies(Protocol):
    """The copies between a device's memory and the host's, each done when it returns."""

    def on_device(self, t: torch.Tensor) -> bool:
        """Whether `t` lies in a device's memory (it must be staged to be sent)."""
        ...

    def to_host(self, src: torch.Tensor, into: torch.Tensor) -> None:
        """`src` (on the device) into `into` (on the host, as many bytes)."""
        ...

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """`src` (on the host) into `dst` (on the device, as many bytes)."""
        ...


class TorchChunkCopies:
    """Torch's own copies, each done when it returns: a buffer is reused, and a host tensor
    read, right after. On CUDA a `non_blocking` copy then a wait on an event recorded after it
    on this (copying) thread's stream: this thread waits, no other stream or thread."""

    def on_device(self, t: torch.Tensor) -> bool:
        return t.device.type != "cpu"

    def to_host(self, src: torch.Tensor, into: torch.Tensor) -> None:
        _copy(into, src, src.device)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        _copy(dst, src, dst.device)


def _copy(dst: torch.Tensor, src: torch.Tensor, device: torch.device) -> None:
    """`src` into `dst`, landed when it returns; `device` the side that is a device's, if any."""
    if device.type != "cuda":
        dst.copy_(src)
        return
    dst.copy_(src, non_blocking=True)
    _landed(device)


def _landed(device: torch.device) -> None:
    """Until the copies queued on `device`'s current stream (this thread's) have run."""
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    done.synchronize()


def _raw(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes as a 1-D uint8 view (`t` contiguous; reshape first: a 0-dim tensor cannot be
    viewed as a dtype of another size)."""
    return t.detach().reshape(-1).view(torch.uint8)


class Staging:
    """Chunk-by-chunk copies of device tensors through at most `buffers` host buffers of
    `chunk_bytes` each, made at their first use and reused (thread-safe: a copy holds its buffer
    only while it copies and frames, never across an await)."""

    def __init__(
        self,
        chunk_bytes: int,
        copies: ChunkCopies | None = None,
        *,
        pinned: bool = False,
        buffers: int = BUFFERS,
    ) -> None:
        if chunk_bytes <= 0 or buffers < 1:
            raise ConfigError(f"staging needs chunk_bytes > 0 and buffers >= 1: {chunk_bytes}")
        self.chunk_bytes, self.copies = chunk_bytes, copies or TorchChunkCopies()
        self._pinned, self._most = pinned and torch.cuda.is_available(), buffers
        self._free: list[torch.Tensor] = []
        self._made = 0
        self._ready = threading.Condition()

    @contextlib.contextmanager
    def _buffer(self) -> Iterator[torch.Tensor]:
        with self._ready:
            while not self._free and self._made >= self._most:
                self._ready.wait()
            if self._free:
                buffer = self._free.pop()
            else:
                buffer = torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=self._pinned)
                self._made += 1
        try:
            yield buffer
        finally:
            with self._ready:
                self._free.append(buffer)
                self._ready.notify()

    def to_host(self, src: torch.Tensor) -> torch.Tensor:
        """A new host tensor holding `src` (a device's, contiguous), copied chunk by chunk."""
        host = torch.empty(src.shape, dtype=src.dtype)
        raw_src, raw_host, step = _raw(src), _raw(host), self.chunk_bytes
        for a in range(0, raw_src.numel(), step):
            self.copies.to_host(raw_src[a : a + step], raw_host[a : a + step])
        return host

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """`src` (on the host) into `dst` (a device's, contiguous, alike), chunk by chunk."""
        raw_dst, raw_src, step = _raw(dst), _raw(src.contiguous()), self.chunk_bytes
        if raw_dst.numel() != raw_src.numel():
            raise ValueError(f"{raw_src.numel()} bytes into a tensor of {raw_dst.numel()}")
        for a in range(0, raw_dst.numel(), step):
            self.copies.to_device(raw_dst[a : a + step], raw_src[a : a + step])

    def split(
        self,
        header: M,
        name: str,
        tensor: torch.Tensor | Callable[[], torch.Tensor],
        lock: AbstractContextManager[Any] | None = None,
    ) -> Iterator[M | framing.Framed]:
        """`wire.split_tensor`'s messages (a receiver tells no difference), each chunk copied
        from the device only as it is cut: one chunk's bytes on the host at a time. A host
        tensor is cut from its own memory as `split_tensor` does. `tensor` may be a function
        giving it, asked again for every chunk under `lock` (`stage_server.replica.snapshot`)."""

        def current() -> torch.Tensor:
            return tensor() if callable(tensor) else tensor

        guard = lock if lock is not None else contextlib.nullcontext()
        cls, chunk = type(header), self.chunk_bytes

        def cut(start: int) -> tuple[torch.Tensor, framing.Framed | bytes]:
            with guard:
                t = current()
                piece = _raw(t.contiguous())[start : start + chunk]
                if not self.copies.on_device(t):
                    return t, _framed(cls, t.nbytes <= chunk, piece)
                with self._buffer() as buffer:
                    host = buffer[: piece.numel()]
                    self.copies.to_host(piece, host)
                    return t, _framed(cls, t.nbytes <= chunk, host)  # copied: buffer free

        yield from wire.split_cuts(header, name, chunk, cut)


def _framed(cls: Any, whole: bool, piece: torch.Tensor) -> framing.Framed | bytes:
    """`piece` (host bytes) as the header's bytes when the tensor is `whole` in one chunk, else
    as a chunk message; copied either way."""
    if whole:
        return piece.numpy().tobytes()
    return framing.frame(cls, 0, wire.tensor_bytes(piece))


# Two sizes kept: a stage's state downloads' (`CHUNK`) and its job's `chunk_bytes`. Cached for
# good, each new job's own size pinned 2 x 16 MiB more of host memory, for the process's life.
@functools.lru_cache(maxsize=2)
def _shared(chunk_bytes: int) -> Staging:
    return Staging(chunk_bytes, TorchChunkCopies(), pinned=True)


def staging(chunk_bytes: int, copies: ChunkCopies | None = None) -> Staging:
    """The staging of chunks of `chunk_bytes` through `copies`: torch's (None) share the
    process's pinned buffers of the two sizes used last, made once for as long as they are
    (pinning memory is slow: not at every round or download), whichever round or download
    stages; another's (a test's) its own."""
    return _shared(chunk_bytes) if copies is None else Staging(chunk_bytes, copies)


class OffLoop:
    """Where one round's (or download's) device copies run: one after another, in the order
    they were asked for, on a thread of its own (made at the first copy), so the event loop
    never waits on the device. A copy and the framing of its chunk run together there, so a
    staging buffer is free again before the loop sees the chunk's bytes. `on=False` (nothing
    on a device: no copy to wait on) runs each call where it is asked, as before. A CUDA
    `device` is made its thread's current one (a thread starts on `cuda:0`: what it allocates,
    and the stream it copies on, are then the served device's)."""

    def __init__(self, on: bool, device: torch.device | None = None) -> None:
        self._pool: ThreadPoolExecutor | None = None
        if on and device is not None and device.type == "cuda":
            self._pool = ThreadPoolExecutor(1, "staging", torch.cuda.set_device, (device,))
        elif on:
            self._pool = ThreadPoolExecutor(1, "staging")

    async def __call__(self, fn: Callable[..., T], *args: Any) -> T:
        if self._pool is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, functools.partial(fn, *args)
        )

    async def next(self, messages: Iterator[T]) -> T | None:
        """`messages`' next one (a `Staging.split` copies its chunk as it is cut), or None."""
        return await self(next, messages, None)

    async def close(self) -> None:
        """Once the copies already under way have ended (one cancelled before it began never
        runs): after this no copy writes into a gradient its round has given back."""
        if self._pool is None:
            return
        try:
            await asyncio.get_running_loop().run_in_executor(self._pool, _nothing)
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        """Its thread ends once the copies under way have (not waited for: none is cancelled)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def _nothing() -> None:
    """Run after every copy asked before it (`OffLoop`'s one thread takes them in order)."""
