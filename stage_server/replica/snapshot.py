"""A replica's state of one step, served without a copy of it (DownloadState: a joiner's copy of a
member, a checkpoint).

A snapshot holds the replica's own parameter and optimizer tensors, not copies of them: a large
stage's state is not doubled to be sent. Before the replica changes its state in place (an update
applied, a round's outer step, a state loaded), it has its open snapshots `detach`: each copies
the tensors it has not sent yet (the one being sent included), so what it sends stays of its
step. A download that ends before the next update, the usual case for a checkpoint taken between
commits, copies nothing; one that is still running then costs what a snapshot used to cost
(a copy of what is left), no more.

Threads: `detach` runs on the replica's worker; the reply is built on the event loop, or, for a
snapshot `on_device`, on a thread of the download's (`stage_server.replica.state_transfer` asks for
each message there: a chunk's copy from the device, and a detach's wait for the lock, never hold the
loop); both take the snapshot's lock (a threading lock) for each chunk, so a chunk is read
wholly before or wholly after a detach, never from a tensor being changed.

A device's tensors (CUDA) are shared too, not copied to the host when the snapshot is taken (that
was 12 B a parameter of host memory per download running): each chunk is copied to a reusable
host buffer only as it is sent (`stage_server.averaging.staging`), under the lock. A detach
copies what is left to the host, not the device (whose memory is the scarce one), before the
worker launches the kernels that change it; the chunk copies and the detach's are blocking, on
the stream the worker's kernels run on, so a chunk holds the bytes of the snapshot's step, never
those of a kernel still running or launched after: a step boundary cannot mix two states.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Collection, Iterator
from typing import TypeVar

import torch
from google.protobuf.message import Message

from stage_server.averaging.staging import ChunkCopies, TorchChunkCopies, staging

__all__ = ["Snapshot", "Snapshots"]

M = TypeVar("M", bound=Message)
CHUNK = 4 << 20  # bytes a detach copies from a device at a time


class Snapshot:
    """The state of step `step` (`state`: name -> tensor, in the order they are sent), whose
    tensors named in `shared` are the replica's own."""

    def __init__(
        self,
        step: int,
        state: dict[str, torch.Tensor],
        shared: Collection[str],
        copies: ChunkCopies | None = None,
    ) -> None:
        self.step = step
        self._given = copies  # a test's fake device, or None: torch's
        self._copies = copies or TorchChunkCopies()
        self._state = state  # what is left to send
        self._shared = set(shared) & state.keys()  # of those, the replica's own
        # Whether its chunks are copied from a device as they are sent (off the event loop),
        # and which (its copying thread's current one).
        devices = [t.device for t in state.values() if self._copies.on_device(t)]
        self.on_device, self.device = bool(devices), devices[0] if devices else None
        self._lock = threading.Lock()
        self.copied_bytes = 0  # what `detach` copied

    def detach(self) -> None:
        """Copy the replica's own tensors not sent yet: it is about to change them."""
        with self._lock:
            for name in self._shared:
                tensor = self._state[name]
                if self._copies.on_device(tensor):  # to the host, where it is to be sent
                    self._state[name] = staging(CHUNK, self._given).to_host(tensor)
                else:
                    self._state[name] = tensor.clone()
                self.copied_bytes += tensor.nbytes
            self._shared.clear()

    def reply(self, header: Callable[[], M], chunk_bytes: int) -> Iterator[M]:
        """The messages of the state, one tensor after another in chunks of at most
        `chunk_bytes` (`wire.split_tensor`'s messages, each tensor under a fresh `header()`);
        each tensor is let go once sent, so what the snapshot holds shrinks as it streams. A
        device's tensor is copied to the host a chunk at a time, as it is sent."""
        staged = staging(chunk_bytes, self._given)
        for name in list(self._state):
            yield from staged.split(
                header(), name, functools.partial(self._state.__getitem__, name), self._lock
            )
            with self._lock:
                del self._state[name]
                self._shared.discard(name)


class Snapshots:
    """A replica's open snapshots (weakly: a reply dropped unfinished lets its snapshot go)."""

    def __init__(self, copies: ChunkCopies | None = None) -> None:
        self._open: weakref.WeakSet[Snapshot] = weakref.WeakSet()
        self._lock = threading.Lock()
        self.copies = copies  # a test's fake device, or None: torch's

    def open(self, step: int, state: dict[str, torch.Tensor], shared: Collection[str]) -> Snapshot:
        snapshot = Snapshot(step, state, shared, self.copies)
        with self._lock:
            self._open.add(snapshot)
        return snapshot

    def detach(self) -> None:
        """Before the replica's state changes in place."""
        with self._lock:
            snapshots = list(self._open)
        for snapshot in snapshots:
            snapshot.detach()
