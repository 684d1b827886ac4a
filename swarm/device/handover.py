"""The handover: how a stage server gives a co-located one a tensor's encoded bytes through
memory instead of gRPC (the issue 53 data path; docs/architecture.md, "Handover"). The bytes are
the wire's own (after the codec), so whichever way a hop goes the receiver decodes the very
same payload: a replay on another path computes the same thing, bit for bit.

Lifetimes are explicit, and belong to the side that knows when a call ends, the caller:
- `offer` puts a payload where the other process can read it; the caller keeps it until its
  call ended (answered or failed) and then `release`s it. The receiver `take`s a copy of its
  own at once, so nothing it keeps depends on the sender living on.
- `slot` is the caller's room for the answer's bytes ("grad_inputs"); the receiver `fill`s it
  before it answers, and the caller reads it (`Offer.read`) and releases it.
- An offer or slot its caller knows no receiver mapped (refused, busy, answered with bytes) is
  said `unused` before it is released: CUDA IPC keeps it otherwise (`swarm.device.offer`).
- A receiver that cannot take a handle raises; its replica refuses the call as
  `HandoverRefused`, and the caller sends the bytes (`stage_server.replica.handing`).
A SIGKILLed caller cannot release: shared memory is swept on the next start of any process on
the host (`swarm.device.shm_handover.sweep`); CUDA memory is the driver's, freed with its process.

Implementations: `swarm.device.shm_handover` (CPU tensors, POSIX shared memory) and
`swarm.device.cuda_handover` (CUDA IPC, on the device). Which one a process uses: `handover_for`."""

from __future__ import annotations

from typing import Protocol

import torch

from swarm.device.offer import Offer
from swarm.proto import tensor_pb2

__all__ = ["Handover", "Offer", "handover_for"]


class Handover(Protocol):
    kind: str  # "shm", "cuda": the `Handover` field it fills

    def offer(self, payload: torch.Tensor) -> Offer:
        """`payload` (the encoded bytes, 1-D uint8 on this handover's device) handed over."""
        ...

    def take(self, handle: tensor_pb2.Handover, nbytes: int) -> torch.Tensor:
        """A copy, this process's own, of the `nbytes` bytes `handle` names (InvalidArgument
        when it names none of this kind, or another size)."""
        ...

    def slot(self, nbytes: int) -> Offer:
        """Room for `nbytes` bytes the other process writes (`fill`)."""
        ...

    def fill(self, handle: tensor_pb2.Handover, payload: torch.Tensor) -> bool:
        """Write `payload` into the slot `handle` names, done when this returns; False when
        it cannot be opened from here (the caller then gets the bytes on the wire)."""
        ...


def handover_for(device: torch.device) -> Handover:
    """The handover of tensors on `device`."""
    if device.type == "cuda":
        from swarm.device.cuda_handover import CudaHandover  # only where CUDA is

        return CudaHandover(device)
    from swarm.device.shm_handover import SharedMemoryHandover

    return SharedMemoryHandover()
