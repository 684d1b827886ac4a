"""The device calls of the CUDA handover (`swarm.device.cuda_handover`), behind one seam: share an
allocation, rebuild (map) one another process shared, copy out of and into a mapping with the
streams and waits that takes, and the process's own offers. `TorchIpc` makes them with torch
on a CUDA device; `HostIpc` is a CPU stand-in that keeps the same contracts, so the handover's
logic (the handle as fields and back, offsets and sizes, the own-offer lookup, lifetimes,
fallbacks) runs, all of it, where there is no GPU (its tests).

The handles are torch's and opaque: whatever `UntypedStorage._share_cuda_` gives goes into
`torch.multiprocessing.reductions.rebuild_cuda_tensor` on the other side unchanged (torch 2.11
writes a version byte and a type byte before the 64-byte `cudaIpcMemHandle_t`, 66 bytes; an
expandable segment's handle is longer; older torch wrote the 64 bytes alone)."""

from __future__ import annotations

import inspect
import secrets
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.multiprocessing.reductions import StorageWeakRef, rebuild_cuda_tensor

__all__ = ["CudaIpc", "HostDevice", "HostIpc", "OwnKey", "Shared", "TorchIpc", "torch_handle"]

# An offer of this process: (its allocation's handle, the storage's offset in that allocation,
# the payload's offset in the storage). The handle alone names an allocation, which holds many
# storages (the caching allocator's blocks): a key without the offsets would mistake one for
# another.
OwnKey = tuple[bytes, int, int]


@dataclass(frozen=True)
class Shared:
    """What torch's `UntypedStorage._share_cuda_` says of a storage, field for field (the
    `CudaIpc` message's too): its allocation's handle, its size and offset in that allocation,
    the shared reference counter torch keeps it alive with, and the event of its last write."""

    device: int
    storage: bytes
    storage_bytes: int
    storage_offset_bytes: int
    ref_counter: bytes
    ref_counter_offset: int
    event: bytes
    event_sync_required: bool


class CudaIpc(Protocol):
    """The device calls a CUDA handover makes (`TorchIpc`; `HostIpc` on a CPU)."""

    device: torch.device  # where its payloads are
    index: int  # the device's index, as handles name it

    def empty(self, nbytes: int) -> torch.Tensor:
        """`nbytes` bytes of new memory on the device (a slot)."""
        ...

    def share(self, payload: torch.Tensor) -> Shared:
        """`payload`'s storage shared: what another process rebuilds it from."""
        ...

    def rebuild(self, args: tuple[Any, ...]) -> torch.Tensor:
        """The tensor `rebuild_cuda_tensor(*args)` maps from another process's allocation."""
        ...

    def copy_out(self, mapped: Callable[[], torch.Tensor], own: bool = False) -> torch.Tensor:
        """A copy of this process's own of what `mapped()` maps, done when this returns (the
        mapping may go then), usable on the device's default stream. `own`: `mapped()` is a
        tensor of this process's, written on its default stream (no event to wait for)."""
        ...

    def copy_in(self, mapped: torch.Tensor, payload: torch.Tensor) -> None:
        """`payload` written into `mapped`, done when this returns."""
        ...

    def offered(self, key: OwnKey, payload: torch.Tensor) -> None:
        """`payload`, offered by this process under `key` (until `withdrawn`)."""
        ...

    def own(self, key: OwnKey) -> torch.Tensor | None:
        """This process's own offer under `key`: CUDA IPC opens no allocation in the process
        that made it, and servers in one process hand over to each other."""
        ...

    def withdrawn(self, key: OwnKey) -> None:
        """The offer under `key` released."""
        ...

    def returned(self, ref_counter: bytes, ref_counter_offset: int) -> None:
        """One receiver's count of a share given back without a mapping: torch keeps a shared
        allocation its maker freed until the receiver each share counts on let go of its
        mapping. For a share no receiver maps (its maker knows) and one this process took from
        its own tensor."""
        ...


# This process's offers (the own-offer lookup), weakly: a released offer's payload is freed
# with its last reference, whatever this map says.
_OFFERED: weakref.WeakValueDictionary[OwnKey, torch.Tensor] = weakref.WeakValueDictionary()


class TorchIpc:
    """The handover's device calls on a CUDA device, made with torch."""

    def __init__(self, device: torch.device) -> None:
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", self.index)
        self._stream: torch.cuda.Stream | None = None  # the takes' own, made at the first

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def share(self, payload: torch.Tensor) -> Shared:
        # records an event after the writes queued so far, which the receiver waits for
        return Shared(*payload.untyped_storage()._share_cuda_())  # type: ignore[attr-defined]

    def rebuild(self, args: tuple[Any, ...]) -> torch.Tensor:
        with torch.cuda.device(self.device):
            return rebuild_cuda_tensor(*args)  # type: ignore[no-untyped-call, no-any-return]

    def copy_out(self, mapped: Callable[[], torch.Tensor], own: bool = False) -> torch.Tensor:
        # On a stream of its own: a receiver takes on its event loop, and waits for this copy
        # (and the sender's event, which the mapping queues on this stream), not for the
        # compute queued on the default stream; but for a tensor of its own, which has no event.
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        if own:
            self._stream.wait_stream(torch.cuda.default_stream(self.device))
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            source = mapped()
            out = source.clone()
            # The copy done before the mapping goes: then the sender may reuse its memory.
            self._stream.synchronize()
        del source
        # The stages compute on the default stream: its memory is not reused before they did.
        out.record_stream(torch.cuda.default_stream(self.device))
        return out

    def copy_in(self, mapped: torch.Tensor, payload: torch.Tensor) -> None:
        with torch.cuda.device(self.device):
            mapped.copy_(payload.to(self.device))
            torch.cuda.current_stream(self.device).synchronize()  # written before the answer

    def offered(self, key: OwnKey, payload: torch.Tensor) -> None:
        _OFFERED[key] = payload

    def own(self, key: OwnKey) -> torch.Tensor | None:
        return _OFFERED.get(key)

    def withdrawn(self, key: OwnKey) -> None:
        _OFFERED.pop(key, None)

    def returned(self, ref_counter: bytes, ref_counter_offset: int) -> None:
        # what `rebuild_cuda_tensor` does for a storage it maps already
        torch.UntypedStorage._release_ipc_counter(  # type: ignore[attr-defined]
            ref_counter, ref_counter_offset, device=self.device
        )


def torch_handle() -> bytes:
    """A handle in torch 2.11's format for a `cudaMalloc` block: version 2, type `c`, then the
    64 bytes of a `cudaIpcMemHandle_t` (random here)."""
    return b"\x02c" + secrets.token_bytes(64)


@dataclass
class HostDevice:
    """The stand-in's device: the allocations its processes (`HostIpc`s) shared, by handle, and
    handles made by `handle` (torch 2.11's format unless a test asks another). As torch's,
    each share counts on one receiver, which gives its count back when its mapping goes; an
    allocation lives while its maker holds it or a share of it still counts on a receiver
    (torch's "limbo")."""

    handle: Callable[[], bytes] = torch_handle
    _storages: dict[bytes, StorageWeakRef] = field(default_factory=dict)
    _handles: dict[int, bytes] = field(default_factory=dict)  # a storage's address -> handle
    _counts: dict[int, int] = field(default_factory=dict)  # a share -> receivers counted on
    _limbo: dict[int, torch.UntypedStorage] = field(default_factory=dict)  # held for them

    _lock: threading.Lock = field(default_factory=threading.Lock)  # servers' threads share it

    def share(self, storage: torch.UntypedStorage) -> tuple[bytes, int]:
        """`storage`'s allocation's handle, and the new share's counter."""
        ptr = storage.data_ptr()
        with self._lock:
            handle = self._handles.get(ptr)
            if handle is None or self._storages[handle].expired():
                handle = self.handle()
                self._handles[ptr], self._storages[handle] = handle, StorageWeakRef(storage)
            counter = len(self._counts)
            self._counts[counter], self._limbo[counter] = 1, storage
        return handle, counter

    def returned(self, counter: int) -> None:
        with self._lock:
            self._counts[counter] -= 1
            if self._counts[counter] <= 0:
                self._limbo.pop(counter, None)

    def opened(self, handle: bytes) -> torch.UntypedStorage:
        ref = self._storages.get(handle)
        if ref is None or ref.expired():
            raise RuntimeError("CUDA error: invalid resource handle")  # as the driver says
        return torch.UntypedStorage._new_with_weak_ptr(ref.cdata)  # type: ignore[attr-defined, no-any-return]

    def live(self) -> int:
        """How many shared allocations are still alive (held by a process, or in limbo)."""
        return len(self.alive())

    def alive(self) -> frozenset[bytes]:
        """The handles of the shared allocations still alive (held by a process, or in limbo)."""
        with self._lock:  # the servers' threads add to it as it is read
            storages = list(self._storages.items())
        return frozenset(handle for handle, ref in storages if not ref.expired())


_REBUILD = inspect.signature(rebuild_cuda_tensor)


class HostIpc:
    """A CPU stand-in for `TorchIpc`: one process of a `HostDevice`. It keeps CUDA IPC's rules:
    a handle opens only in another process (`HostIpc`) than the one that shared it, and only
    while its allocation lives; `rebuild` takes the very arguments torch's `rebuild_cuda_tensor`
    takes (bound to its signature, so a change of torch's shows here) and maps the allocation
    itself (writes through the mapping land in the sharer's memory). `rebuilt` keeps each
    call's arguments, by name."""

    def __init__(self, host: HostDevice) -> None:
        self.host, self.device, self.index = host, torch.device("cpu"), 0
        self.rebuilt: list[dict[str, Any]] = []
        self._mine: set[bytes] = set()  # handles this process shared
        self._offered: dict[OwnKey, torch.Tensor] = {}

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def share(self, payload: torch.Tensor) -> Shared:
        storage = payload.untyped_storage()
        handle, counter = self.host.share(storage)
        self._mine.add(handle)
        return Shared(self.index, handle, storage.nbytes(), 0, b"/host", counter, bytes(64), True)

    def rebuild(self, args: tuple[Any, ...]) -> torch.Tensor:
        a = _REBUILD.bind(*args).arguments
        self.rebuilt.append(dict(a))
        if a["storage_handle"] in self._mine:
            raise RuntimeError("CUDA error: invalid device context")  # its own: IPC opens none
        storage = self.host.opened(a["storage_handle"])
        if storage.nbytes() != a["storage_size_bytes"] or a["storage_offset_bytes"]:
            raise RuntimeError("CUDA error: invalid argument")
        whole = torch.empty(0, dtype=a["dtype"]).set_(storage)  # type: ignore[call-overload]
        mapping = whole.as_strided(a["tensor_size"], a["tensor_stride"], a["tensor_offset"])
        # as torch's mapping does when it goes: its receiver's count given back
        weakref.finalize(mapping, self.host.returned, a["ref_counter_offset"])
        return mapping

    def copy_out(self, mapped: Callable[[], torch.Tensor], own: bool = False) -> torch.Tensor:
        return mapped().clone()

    def copy_in(self, mapped: torch.Tensor, payload: torch.Tensor) -> None:
        mapped.copy_(payload)

    def returned(self, ref_counter: bytes, ref_counter_offset: int) -> None:
        self.host.returned(ref_counter_offset)

    def offered(self, key: OwnKey, payload: torch.Tensor) -> None:
        self._offered[key] = payload

    def own(self, key: OwnKey) -> torch.Tensor | None:
        return self._offered.get(key)

    def withdrawn(self, key: OwnKey) -> None:
        self._offered.pop(key, None)
