"""The handover of CUDA tensors (`swarm.device.handover`) by CUDA IPC, device to device: the
sender shares the allocation that holds the payload (torch's `_share_cuda_`, what
`torch.multiprocessing` sends between processes), the receiver maps it through torch's own path
(`torch.multiprocessing.reductions.rebuild_cuda_tensor`) and copies it into a tensor of its own
on the same device. The handle travels as fields (`CudaIpc`), never as a pickle, and as torch
made it: its handles are opaque bytes whose length and layout are torch's (torch 2.11's is 66
bytes, older ones 64, an expandable segment's more), bounded here only so that a hostile
message stays small. The device calls are behind `swarm.device.cuda_ipc`'s seam, so all of this
logic runs on a CPU too (`HostIpc`).

Lifetimes: the sender's `Offer` holds the payload tensor until the call ended, then releases it
(drops it and withdraws it from this process's own offers), so torch frees the allocation once
no receiver maps it: torch's shared reference counter keeps it from being reused while one
does, and the receiver lets go right after its copy (it waits for the copy first), giving back
the count torch keeps the allocation for. A share that no receiver ever maps (the hop went
elsewhere, was refused or busy; a slot answered with bytes) would keep it in torch's "limbo" for
good: its sender gives that count back (`Offer.unused`) before it releases it, and a process
that takes its own offer does as a mapping would. A dead sender's memory is the driver's to
free; a receiver copies before it answers, so it never reads it afterwards.

CUDA IPC cannot open an allocation in the process that made it: a handle this process offered
is taken from its own tensor (servers in one process, as tests run them).

Only between processes on the same device (`swarm.device.site` names the device's UUID): a
receiver maps the allocation on the device that made it. Whatever cannot be taken is refused
(`InvalidArgument` from here, a CUDA error from torch); the replica refuses the call and its
caller sends the bytes on the wire instead (`stage_server.replica.handing`)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from swarm.device.cuda_ipc import CudaIpc, OwnKey, TorchIpc
from swarm.device.offer import Offer
from swarm.errors import InvalidArgument
from swarm.proto import tensor_pb2

__all__ = ["MAX_HANDLE_BYTES", "REF_COUNTERS", "CudaHandover", "rebuild_args"]

log = logging.getLogger(__name__)

# The most bytes one of torch's opaque handles may have here: not torch's format (which this
# assumes nothing of), a bound on what a hostile message makes this process hold and pass on.
MAX_HANDLE_BYTES = 1024
# The slots of torch's file of share counters (its CUDA_IPC_REF_COUNTER_FILE_SIZE): a handle's
# `ref_counter_offset` names one, and torch counts a share there (and back at its end) without
# a check of its own; a slot past the file's end would be a write past the file's mapping.
REF_COUNTERS = 10_000


class CudaHandover:
    kind = "cuda"

    def __init__(self, device: torch.device, ipc: CudaIpc | None = None) -> None:
        self.ipc = ipc if ipc is not None else TorchIpc(device)
        self.device = self.ipc.device

    def offer(self, payload: torch.Tensor) -> Offer:
        if payload.device != self.device or payload.dtype != torch.uint8 or payload.dim() != 1:
            raise InvalidArgument(f"a CUDA handover offers 1-D uint8 on {self.device}")
        s = self.ipc.share(payload)
        handle = tensor_pb2.Handover(
            cuda=tensor_pb2.CudaIpc(
                device=s.device,
                storage=s.storage,
                storage_bytes=s.storage_bytes,
                storage_offset_bytes=s.storage_offset_bytes,
                ref_counter=s.ref_counter,
                ref_counter_offset=s.ref_counter_offset,
                event=s.event,
                event_sync_required=s.event_sync_required,
                offset=int(payload.storage_offset()),
            )
        )
        key = _own_key(handle.cuda)
        self.ipc.offered(key, payload)
        held: list[torch.Tensor] = [payload]  # alive until released
        counted = [True]  # the one receiver torch counts on, until it is given back

        def unused() -> None:
            if counted and held:
                counted.clear()
                self.ipc.returned(s.ref_counter, s.ref_counter_offset)

        def release() -> None:
            held.clear()  # the payload's last reference here: torch may free it now
            self.ipc.withdrawn(key)

        return Offer(handle, payload.numel(), read=lambda: held[0], release=release, unused=unused)

    def take(self, handle: tensor_pb2.Handover, nbytes: int) -> torch.Tensor:
        args = rebuild_args(handle, nbytes, self.ipc.index)  # checked before any device call
        own = self._own(handle.cuda, nbytes)
        if own is None:
            return self.ipc.copy_out(lambda: self.ipc.rebuild(args))
        out = self.ipc.copy_out(lambda: own, own=True)
        # taken without a mapping, whose end would have given the count back
        self.ipc.returned(handle.cuda.ref_counter, handle.cuda.ref_counter_offset)
        return out

    def slot(self, nbytes: int) -> Offer:
        return self.offer(self.ipc.empty(nbytes))

    def fill(self, handle: tensor_pb2.Handover, payload: torch.Tensor) -> bool:
        try:
            args = rebuild_args(handle, payload.numel(), self.ipc.index)
            own = self._own(handle.cuda, payload.numel())
            mapped = own if own is not None else self.ipc.rebuild(args)
        except Exception as e:  # another device's, another host's, gone: the wire then
            log.info("a CUDA handover slot that does not open here (%r): answered on the wire", e)
            return False
        self.ipc.copy_in(mapped, payload)
        del mapped
        if own is not None:  # filled without a mapping, whose end would give the count back
            self.ipc.returned(handle.cuda.ref_counter, handle.cuda.ref_counter_offset)
        return True

    def _own(self, c: tensor_pb2.CudaIpc, nbytes: int) -> torch.Tensor | None:
        """This process's own offer that `c` names (None: another process's)."""
        own = self.ipc.own(_own_key(c))
        if own is not None and own.numel() != nbytes:
            raise InvalidArgument(f"CUDA handover: {own.numel()} bytes, not {nbytes}")
        return own


def rebuild_args(handle: tensor_pb2.Handover, nbytes: int, index: int) -> tuple[Any, ...]:
    """The arguments of torch's `rebuild_cuda_tensor` for the `nbytes` bytes `handle` names on
    device `index`: a 1-D uint8 tensor at `offset` in the shared storage, its handles passed as
    they came. InvalidArgument for a handle of another kind or device, handles past
    `MAX_HANDLE_BYTES`, negative sizes or offsets, a counter slot past `REF_COUNTERS`, or bytes
    past the storage's end (as the handle says it: the storage's true size is the driver's)."""
    if not handle.HasField("cuda"):
        raise InvalidArgument("not a CUDA handover")
    c = handle.cuda
    if c.device != index:
        raise InvalidArgument(f"a CUDA handover of device {c.device}, not {index}")
    if not c.storage:
        raise InvalidArgument("a CUDA handover without a storage handle")
    for name in ("storage", "ref_counter", "event"):
        size = len(getattr(c, name))
        if size > MAX_HANDLE_BYTES:
            raise InvalidArgument(
                f"a CUDA handover's {name} handle of {size} bytes (at most {MAX_HANDLE_BYTES})"
            )
    if min(nbytes, c.offset, c.storage_bytes, c.storage_offset_bytes, c.ref_counter_offset) < 0:
        raise InvalidArgument("a CUDA handover with a negative size or offset")
    if c.ref_counter_offset >= REF_COUNTERS:
        raise InvalidArgument(
            f"a CUDA handover's ref counter slot {c.ref_counter_offset} of {REF_COUNTERS}"
        )
    if c.offset + nbytes > c.storage_bytes:
        raise InvalidArgument(
            f"CUDA handover: {nbytes} bytes at {c.offset} of a {c.storage_bytes}-byte storage"
        )
    return (
        torch.Tensor,  # tensor_cls
        torch.Size([nbytes]),  # tensor_size
        (1,),  # tensor_stride
        c.offset,  # tensor_offset, in elements: bytes
        torch.UntypedStorage,  # storage_cls
        torch.uint8,  # dtype
        c.device,  # storage_device
        c.storage,  # storage_handle
        c.storage_bytes,  # storage_size_bytes
        c.storage_offset_bytes,  # storage_offset_bytes
        False,  # requires_grad
        c.ref_counter,  # ref_counter_handle
        c.ref_counter_offset,  # ref_counter_offset
        c.event,  # event_handle
        c.event_sync_required,  # event_sync_required
    )


def _own_key(c: tensor_pb2.CudaIpc) -> OwnKey:
    return c.storage, c.storage_offset_bytes, c.offset
