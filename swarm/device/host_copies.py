"""Copies between the served device and the host, off the event loop.

A replica's replies (Forward's outputs, a backward's input gradient) and the activations its push
plane sends on are computed on its device; the event loop only ever sees their bytes on the host.
The copy runs on the replica's worker thread right after the compute (`Worker.run_then`), so a
slow device holds that thread, never the loop that moves every other call's bytes.

`HostCopies` is the seam: `TorchHostCopies` is the real one. On CUDA it copies through reusable
page-locked ("pinned") host buffers (`PinnedPool`, bounded in bytes) with `non_blocking=True`
on a stream of its own, and waits on an event recorded after the copy, on the calling (worker)
thread: the copy runs at the bus's full speed, a copy to the device does not queue behind the
compute stream's kernels (nor a copy to the host behind more than those that wrote its tensor),
and no page-locked buffer is allocated per call. A replica's inputs and incoming gradients come
to the device through it too (`TensorChecks.to_device`). On the CPU a tensor is on the host
already and nothing is copied.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

import torch

__all__ = ["PINNED_POOL_BYTES", "HostCopies", "PinnedPool", "TorchHostCopies"]

# Page-locked memory is taken from the host's RAM for good (the OS cannot page it out): a
# replica's largest reply is one microbatch's activations, so a few of those are plenty.
PINNED_POOL_BYTES = 256 << 20
_MIN_BUCKET = 1 << 12  # smaller buffers are not worth keeping apart


class HostCopies(Protocol):
    """How a replica's tensors cross between its device and the host."""

    def to_host(self, t: torch.Tensor) -> AbstractContextManager[torch.Tensor]:
        """`t` on the host, for as long as the context is open (its buffer may be reused after:
        read it, copy its bytes out, within the context)."""
        ...

    def to_device(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A host tensor `t` on `device` (the copy complete when it returns)."""
        ...


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class PinnedPool:
    """Reusable host buffers of power-of-two sizes, at most `max_bytes` of them alive at once
    (lent or kept). `take` gives None past the bound: the caller copies without one (pageable
    memory, slower, still off the loop) rather than page-lock more of the host's RAM.
    Thread-safe: a replica's worker and its averaging may take buffers at once."""

    def __init__(
        self,
        max_bytes: int = PINNED_POOL_BYTES,
        alloc: Callable[[int], torch.Tensor] = _pinned,
    ) -> None:
        self.max_bytes, self._alloc = max_bytes, alloc
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.allocated = 0  # bytes of buffers alive (lent or kept)
        self.made = 0  # buffers ever allocated: reuse keeps this flat

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 buffer of at least `nbytes`, or None when one would pass the bound."""
        size = max(_MIN_BUCKET, 1 << max(nbytes - 1, 0).bit_length())
        with self._lock:
            kept = self._free.get(size)
            if kept:
                return kept.pop()
            # Buffers of other sizes no one is using give way to this one.
            while self.allocated + size > self.max_bytes and self._drop_one():
                pass
            if self.allocated + size > self.max_bytes:
                return None
            self.allocated += size
            self.made += 1
        try:
            return self._alloc(size)
        except RuntimeError:  # the host would not page-lock more: copy without a buffer
            with self._lock:
                self.allocated -= size
            return None

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer `take` lent, for the next copy of its size."""
        with self._lock:
            self._free.setdefault(buf.numel(), []).append(buf)

    def _drop_one(self) -> bool:
        for size, kept in self._free.items():
            if kept:
                kept.pop()
                self.allocated -= size
                return True
        return False


class TorchHostCopies:
    """The real copies: through `pool`'s pinned buffers on CUDA, none needed on the CPU."""

    def __init__(self, pool: PinnedPool | None = None) -> None:
        self._pool = pool
        self._made_lock = threading.Lock()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    @property
    def pool(self) -> PinnedPool:
        # Made on first use: a CPU replica never page-locks anything (and its torch may be unable).
        with self._made_lock:
            if self._pool is None:
                self._pool = PinnedPool()
            return self._pool

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        """The copies' own stream on `device` (one a device, made on first use): a copy queues
        behind other copies only, never behind the kernels queued on the compute stream."""
        with self._made_lock:
            made = self._streams.get(device)
            if made is None:
                made = self._streams[device] = torch.cuda.Stream(device)
            return made

    def to_host(self, t: torch.Tensor) -> AbstractContextManager[torch.Tensor]:
        return self._to_host(t)

    @contextmanager
    def _to_host(self, t: torch.Tensor) -> Iterator[torch.Tensor]:
        if t.device.type != "cuda":
            yield t.cpu()
            return
        buf = self.pool.take(t.numel() * t.element_size())
        if buf is None:  # past the pool's bound: a pageable copy, blocking this thread only
            yield t.cpu()
            return
        try:
            host = _as(buf, t)
            stream = self.stream(t.device)
            # `t` is written by kernels on the compute stream: the copy starts after them.
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                host.copy_(t, non_blocking=True)
            _wait_for_copy(stream)
            yield host
        finally:
            self.pool.give(buf)

    def to_device(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        if device.type != "cuda" or t.device.type != "cpu":
            return t.to(device)
        buf = self.pool.take(t.numel() * t.element_size())
        if buf is None:
            return t.to(device)
        try:
            staged = _as(buf, t)
            staged.copy_(t)
            stream = self.stream(device)
            with torch.cuda.stream(stream):  # its memory from the copy stream's own blocks
                out = staged.to(device, non_blocking=True)
            # The compute stream uses it next: its memory is not the copy stream's to reuse
            # until that stream's work queued when it is freed has run.
            out.record_stream(torch.cuda.current_stream(device))
            _wait_for_copy(stream)  # the buffer is lent again once given back: the copy is done
            return out
        finally:
            self.pool.give(buf)


def _as(buf: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The first bytes of `buf` viewed as a tensor of `like`'s dtype and shape."""
    nbytes = like.numel() * like.element_size()
    return buf[:nbytes].view(like.dtype).view(like.shape)


def _wait_for_copy(stream: torch.cuda.Stream) -> None:
    # An event after the copy on its stream, waited on here: the worker thread blocks until the
    # bytes have landed (the tensor is complete when the call returns, for any stream after).
    done = torch.cuda.Event()
    done.record(stream)
    done.synchronize()
