"""The handover of CUDA tensors (`swarm.wire.handover`) by CUDA IPC, device to device: the
sender shares the allocation that holds the payload (torch's `_share_cuda_`, what
`torch.multiprocessing` sends between processes), the receiver maps it
(`torch.multiprocessing.reductions.rebuild_cuda_tensor`) and copies it into a tensor of its
own on the same device. The handle travels as fields (`CudaIpc`), never as a pickle.

Lifetimes: the sender's `Offer` holds the payload tensor until the call ended; torch's shared
reference counter keeps the allocation from being reused while a receiver still maps it, and
the receiver lets go right after its copy (it waits for the copy first). A dead sender's memory
is the driver's to free; a receiver copies before it answers, so it never reads it afterwards.
A share that no receiver ever maps (the hop went elsewhere) stays in torch's "limbo" until the
sender frees it: the offer is only made when the next replica is known to be on this device.

CUDA IPC cannot open an allocation in the process that made it: a handle this process offered
is taken from its own tensor (servers in one process, as tests run them).

Only between processes on the same device (`swarm.wire.site` names the device's UUID): a
receiver maps the allocation on the device that made it."""

from __future__ import annotations

import weakref

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from swarm.errors import InvalidArgument
from swarm.proto import tensor_pb2
from swarm.wire.offer import Offer

__all__ = ["CudaHandover"]

_IPC_HANDLE_BYTES = 64  # cudaIpcMemHandle_t, cudaIpcEventHandle_t
# What this process offered, by handle: CUDA IPC cannot open a process's own allocation, and
# stage servers in one process (tests, a trainer beside its servers) hand over to each other.
_OFFERED: weakref.WeakValueDictionary[tuple[bytes, int], torch.Tensor] = (
    weakref.WeakValueDictionary()
)


class CudaHandover:
    kind = "cuda"

    def __init__(self, device: torch.device) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self._stream: torch.cuda.Stream | None = None  # the takes' own, made at the first

    def offer(self, payload: torch.Tensor) -> Offer:
        if payload.device != self.device or payload.dtype != torch.uint8 or payload.dim() != 1:
            raise InvalidArgument(f"a CUDA handover offers 1-D uint8 on {self.device}")
        held: list[torch.Tensor] = [payload]  # alive until released
        (
            device,
            storage,
            storage_bytes,
            storage_offset_bytes,
            ref_counter,
            ref_counter_offset,
            event,
            event_sync_required,
        ) = payload.untyped_storage()._share_cuda_()  # records an event after the writes
        handle = tensor_pb2.Handover(
            cuda=tensor_pb2.CudaIpc(
                device=device,
                storage=storage,
                storage_bytes=storage_bytes,
                storage_offset_bytes=storage_offset_bytes,
                ref_counter=ref_counter,
                ref_counter_offset=ref_counter_offset,
                event=event,
                event_sync_required=event_sync_required,
                offset=int(payload.storage_offset()),
            )
        )
        _OFFERED[storage, int(payload.storage_offset())] = payload
        return Offer(handle, payload.numel(), read=lambda: held[0], release=held.clear)

    def take(self, handle: tensor_pb2.Handover, nbytes: int) -> torch.Tensor:
        # On a stream of its own: a receiver takes on its event loop, and waits for this copy
        # (and the sender's event), not for the compute queued on the default stream.
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            mapped = self._map(handle, nbytes)  # waits for the sender's writes, on this stream
            out = mapped.clone()
            # The copy done before the mapping goes: then the sender may reuse its memory.
            self._stream.synchronize()
        del mapped
        # The stages compute on the default stream: its memory is not reused before they did.
        out.record_stream(torch.cuda.default_stream(self.device))
        return out

    def slot(self, nbytes: int) -> Offer:
        return self.offer(torch.empty(nbytes, dtype=torch.uint8, device=self.device))

    def fill(self, handle: tensor_pb2.Handover, payload: torch.Tensor) -> bool:
        try:
            mapped = self._map(handle, payload.numel())
        except (InvalidArgument, RuntimeError):
            return False  # another device, another host's handle: the wire then
        with torch.cuda.device(self.device):
            mapped.copy_(payload.to(self.device))
            torch.cuda.current_stream(self.device).synchronize()  # written before the answer
        del mapped
        return True

    def _map(self, handle: tensor_pb2.Handover, nbytes: int) -> torch.Tensor:
        c = handle.cuda
        if not handle.HasField("cuda") or c.device != self.device.index:
            raise InvalidArgument(f"not a CUDA handover on {self.device}")
        if len(c.storage) != _IPC_HANDLE_BYTES or c.offset < 0 or nbytes < 0:
            raise InvalidArgument("a malformed CUDA handover")
        if c.offset + nbytes > c.storage_bytes:
            raise InvalidArgument(
                f"CUDA handover: {nbytes} bytes at {c.offset} of a {c.storage_bytes}-byte storage"
            )
        own = _OFFERED.get((c.storage, c.offset))
        if own is not None:  # offered by this very process
            if own.numel() != nbytes:
                raise InvalidArgument(f"CUDA handover: {own.numel()} bytes, not {nbytes}")
            return own
        with torch.cuda.device(self.device):
            return rebuild_cuda_tensor(  # type: ignore[no-untyped-call]
                torch.Tensor,
                torch.Size([nbytes]),
                (1,),
                c.offset,
                torch.UntypedStorage,
                torch.uint8,
                c.device,
                c.storage,
                c.storage_bytes,
                c.storage_offset_bytes,
                False,
                c.ref_counter,
                c.ref_counter_offset,
                c.event,
                c.event_sync_required,
            )
