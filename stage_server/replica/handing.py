"""A replica's side of the handover (`swarm.wire.handover`): its site, the sites of the replicas
it pushes to, and the outgoing tensors it hands over or sends. The issue 53 path: stage servers
on one host (and one device) pass activations and gradients through memory, not gRPC bytes.

Chosen per hop, on the push plane only: a replica announces its site in every Push answer
(`StagePushResponse.site`), and the caller hands the next push to that replica over (its
"inputs" offered, a slot for its "grad_inputs") once they are known to share it; the first push
to each goes on the wire. A replica that cannot open what it is given refuses the call
(InvalidArgument, tried elsewhere), and one that cannot open a slot answers on the wire; so a
wrong guess costs a try, never a wrong tensor. Nothing else (the trainer's calls, the carry
plane, commits, state transfers) is handed over: those take no handle (`chunking.receive`).

The bytes handed over are the wire's, after the codec (`codec.encode_payload`): a tensor
decodes the same either way, so a replay on another path is exact."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from stage_server.peer.metrics import StageMetrics
from stage_server.replica.host_copies import DeviceCopies
from swarm.errors import InvalidArgument
from swarm.ops import faults
from swarm.proto import tensor_pb2
from swarm.wire import codec, hadamard
from swarm.wire.handover import Handover, Offer, handover_for
from swarm.wire.site import site

__all__ = ["Handing", "Outgoing", "reply_header"]


class Handing:
    """The handover of the device a replica serves on (none until `serve`, or where the
    process has no site)."""

    def __init__(
        self,
        metrics: StageMetrics,
        make: Callable[[torch.device], Handover] = handover_for,
        site_of: Callable[[torch.device], str] = site,
    ) -> None:
        self.metrics, self._make, self._site_of = metrics, make, site_of
        self.site = ""  # this replica's ("": it hands nothing over)
        self.handover: Handover | None = None
        self._device: torch.device | None = None
        self._sites: dict[str, str] = {}  # a replica pushed to -> the site its answer named

    def serve(self, device: torch.device) -> None:
        if device == self._device:
            return
        self._device, self.site = device, self._site_of(device)
        self.handover = self._make(device) if self.site else None

    def learned(self, peer: str, its_site: str) -> None:
        """`peer`'s answer named `its_site`."""
        self._sites[peer] = its_site

    def near(self, peer: str) -> bool:
        """Whether a push to `peer` is handed over."""
        return self.handover is not None and self._sites.get(peer) == self.site

    def forms(self, peers: list[str]) -> tuple[bool, bool]:
        """(hand over, send bytes): the forms a push to one of `peers` may take."""
        near = [self.near(p) for p in peers]
        return any(near), not all(near)

    def take(self, _index: int, meta: tensor_pb2.Tensor) -> torch.Tensor:
        """A handed-over tensor's payload (`chunking.Handed`), refused without a handover."""
        if self.handover is None:
            raise InvalidArgument(f"tensor {meta.name!r} was handed over; this replica has no site")
        if faults.refuses_handover():  # SWARM_FAULTS=handover-refuse@0 (issue 63's refusal)
            raise InvalidArgument(f"tensor {meta.name!r}: handover refused (injected fault)")
        payload = self.handover.take(meta.handover, meta.nbytes)
        self.metrics.handed("taken")
        return payload

    def slot(self, outputs: tensor_pb2.Tensor, reply: int, block_size: int) -> Offer | None:
        """Room for the gradient of `outputs` (sent with codec `reply`), for the replica pushed
        to, or None when this replica hands nothing over."""
        if self.handover is None:
            return None
        grad = reply_header(outputs.dtype, outputs.shape, reply, block_size)
        return self.handover.slot(grad.nbytes)

    def fill(
        self, msg: tensor_pb2.Tensor, payload: torch.Tensor, into: tensor_pb2.Handover
    ) -> bool:
        """`msg`'s `payload` written into the caller's slot `into` (`msg` then names it);
        False when it cannot be (the bytes then go in `msg`)."""
        if self.handover is None or not self.handover.fill(into, payload):
            return False
        msg.handover.CopyFrom(into)
        self.metrics.handed("filled")
        return True


def reply_header(
    dtype: str, shape: Sequence[int], reply: int, block_size: int
) -> tensor_pb2.Tensor:
    """The header of a gradient of `dtype` and `shape` encoded with codec `reply`, its `nbytes`
    the payload's (a slot's size; what a gradient that came into one is counted as)."""
    floating = codec.DTYPES[dtype].is_floating_point
    grad = tensor_pb2.Tensor(
        name="grad_inputs",
        dtype=dtype,
        shape=shape,
        codec=reply if floating else codec.CODEC_NONE,  # type: ignore[arg-type]
        block_size=hadamard.BLOCK if reply == codec.CODEC_HADAMARD3 else block_size,
    )
    grad.nbytes = codec.expected_payload(grad)
    return grad


@dataclass
class Outgoing:
    """A replica's outputs on their way to the next stage: its message `header` (no bytes yet)
    and `payload` (the encoded bytes, on the device), as bytes on the wire (`wire`), handed
    over (`handed`), or both, each made once; `release` lets the handed-over bytes go."""

    header: tensor_pb2.Tensor
    payload: torch.Tensor
    copies: DeviceCopies
    handing: Handing
    _wire: tensor_pb2.Tensor | None = None
    _handed: tuple[tensor_pb2.Tensor, Offer] | None = None
    _released: bool = field(default=False)

    def wire(self) -> tensor_pb2.Tensor:
        """The message with its bytes (their copy to the host waits on the device)."""
        if self._wire is None:
            msg = tensor_pb2.Tensor()
            msg.CopyFrom(self.header)
            with self.copies.to_host(self.payload) as on_host:
                msg.data = on_host.numpy().tobytes()
            self._wire = msg
        return self._wire

    def handed(self) -> tensor_pb2.Tensor:
        """The message naming the bytes handed over (offered once, for every try)."""
        if self._handed is None:
            assert self.handing.handover is not None and not self._released
            offer = self.handing.handover.offer(self.payload)
            msg = tensor_pb2.Tensor()
            msg.CopyFrom(self.header)
            msg.handover.CopyFrom(offer.handle)
            self._handed = msg, offer
            self.handing.metrics.handed("offered")
        return self._handed[0]

    def release(self) -> None:
        self._released = True
        if self._handed is not None:
            self._handed[1].release()
