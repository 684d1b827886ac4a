"""A replica's side of the handover (`swarm.device.handover`): its site, the sites of the replicas
it pushes to, and the outgoing tensors it hands over or sends. The issue 53 path: stage servers
on one host (and one device) pass activations and gradients through memory, not gRPC bytes.

Chosen per hop, on the push plane only: a replica announces its site in every Push answer
(`StagePushResponse.site`), and the caller hands the next push to that replica over (its
"inputs" offered, a slot for its "grad_inputs") once they are known to share it; the first push
to each goes on the wire. A replica that cannot open what it is given refuses the call with
`HandoverRefused` (its cause in the text) before it does anything with it; its caller forgets
that replica's site for good and sends the same call on the wire to it at once
(`stage_server.replica.next_hop`), and a replica that cannot open a slot answers on the wire: a
wrong guess costs one try, never a wrong tensor, and never a ban. A replica that cannot offer
(its own handover fails) hands nothing over from then on. Nothing else (the trainer's calls, the
carry plane, commits, state transfers) is handed over: those take no handle
(`chunking.receive`).

The bytes handed over are the wire's, after the codec (`codec.encode_payload`): a tensor
decodes the same either way, so a replay on another path is exact."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from stage_server.peer.metrics import StageMetrics
from swarm.device.handover import Handover, Offer, handover_for
from swarm.device.host_copies import HostCopies
from swarm.device.site import site
from swarm.errors import HandoverRefused
from swarm.ops import faults, timeline
from swarm.proto import tensor_pb2
from swarm.wire import codec, hadamard

__all__ = ["KEPT_PEERS", "Handing", "Outgoing", "Outgoings", "reply_header"]

log = logging.getLogger(__name__)

KEPT_PEERS = 1024  # next replicas whose site (or refusal) a served stage keeps, the latest


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
        self._refused: dict[str, None] = {}  # replicas that refused a handover: the wire
        self._offers = True  # False once an offer failed here: nothing handed over then

    def serve(self, device: torch.device) -> None:
        """A stage served anew: the replicas pushed to before, and those that refused, were
        the last stage's next ones (kept, they grew with every job served, and one that refused
        once was on the wire in every later job)."""
        self._sites.clear()
        self._refused.clear()
        if device == self._device:
            return
        self._device, self.site = device, self._site_of(device)
        self.handover = self._make(device) if self.site else None

    def learned(self, peer: str, its_site: str) -> None:
        """`peer`'s answer named `its_site`. The latest `KEPT_PEERS` are kept: each push whose
        route names a fresh peer (a hostile caller's, answered at the address it names) added
        one for as long as the stage was served."""
        self._sites.pop(peer, None)
        self._sites[peer] = its_site  # the latest last
        while len(self._sites) > KEPT_PEERS:
            del self._sites[next(iter(self._sites))]

    def near(self, peer: str) -> bool:
        """Whether a push to `peer` is handed over."""
        return (
            self.handover is not None
            and self._offers
            and peer not in self._refused
            and self._sites.get(peer) == self.site
        )

    def refused(self, peer: str, error: HandoverRefused) -> None:
        """`peer` could not take what was handed over to it: its site is forgotten, and every
        later push to it goes on the wire (its answers naming our site again change nothing:
        a wrong guess costs one try, not one try every other push)."""
        first = peer not in self._refused  # others in flight then may be refused too
        self._refused.pop(peer, None)
        self._refused[peer] = None  # the latest last; an old one forgotten tries once more
        while len(self._refused) > KEPT_PEERS:
            del self._refused[next(iter(self._refused))]
        self._sites.pop(peer, None)
        self.metrics.handed("refused")
        level = logging.WARNING if first else logging.INFO
        log.log(level, "%s: %s; sending to it on the wire from now on", peer, error)

    def offer_failed(self, error: Exception) -> None:
        """This replica's own handover could not offer: nothing is handed over from now on."""
        if self._offers:
            log.warning(
                "the %s handover cannot offer (%r): every push goes on the wire", self.site, error
            )
        self._offers = False

    def forms(self, peers: list[str]) -> tuple[bool, bool]:
        """(hand over, send bytes): the forms a push to one of `peers` may take."""
        near = [self.near(p) for p in peers]
        return any(near), not all(near)

    def take(self, _index: int, meta: tensor_pb2.Tensor) -> torch.Tensor:
        """A handed-over tensor's payload (`chunking.Handed`). Whatever keeps it from being
        taken (no handover here, a handle this process cannot open, memory gone) is one
        refusal, `HandoverRefused`, with its cause: the caller then sends the bytes."""
        why = f"{HandoverRefused.PREFIX}: tensor {meta.name!r}"
        if self.handover is None:
            raise HandoverRefused(f"{why}: this replica has no handover site")
        if faults.refuses_handover():  # SWARM_FAULTS=handover-refuse@0: b8f54b2's refusal
            raise HandoverRefused(f"{why}: injected fault (handover-refuse)")
        try:
            start = timeline.now()
            payload = self.handover.take(meta.handover, meta.nbytes)
            timeline.span("take", start, timeline.now(), nbytes=meta.nbytes)
        except Exception as e:  # any way it fails, the wire is the answer: named, not hidden
            log.info("%s: %r", why, e)
            raise HandoverRefused(f"{why}: {e}") from e
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
    copies: HostCopies
    handing: Handing
    _wire: tensor_pb2.Tensor | None = None
    _handed: tuple[tensor_pb2.Tensor, Offer] | None = None
    _released: bool = field(default=False)
    _taken: bool = field(default=False)  # a receiver may have mapped the bytes handed over

    @property
    def made_wire(self) -> tensor_pb2.Tensor | None:
        """The message with its bytes, where `wire` made it already (None: not made)."""
        return self._wire

    def wire(self) -> tensor_pb2.Tensor:
        """The message with its bytes (their copy to the host waits on the device)."""
        if self._wire is None:
            msg = tensor_pb2.Tensor()
            msg.CopyFrom(self.header)
            with self.copies.to_host(self.payload) as on_host:
                msg.data = on_host.numpy().tobytes()
            self._wire = msg
        return self._wire

    def handed(self) -> tensor_pb2.Tensor | None:
        """The message naming the bytes handed over (offered once, for every try); None when
        this replica's handover could not offer them (they go on the wire then)."""
        if self._handed is None:
            assert self.handing.handover is not None and not self._released
            try:
                offer = self.handing.handover.offer(self.payload)
            except Exception as e:  # its own handover failing: the wire, named once
                self.handing.offer_failed(e)
                return None
            msg = tensor_pb2.Tensor()
            msg.CopyFrom(self.header)
            msg.handover.CopyFrom(offer.handle)
            self._handed = msg, offer
            self.handing.metrics.handed("offered")
        return self._handed[0]

    def taken(self) -> None:
        """A try handed them over to a replica that took them, or may have (its call failed
        after it read them); tries it never reached, or that were refused or turned away busy,
        do not count."""
        self._taken = True

    def release(self) -> None:
        if self._handed is not None and not self._released:
            offer = self._handed[1]
            if not self._taken:  # offered, mapped by nobody: its count back (`Offer.unused`)
                offer.unused()
            offer.release()
        self._released = True


class Outgoings:
    """The outgoing tensors one push makes, released together when it ends (`release`), and one
    made after that, at once: the worker thread makes them, and runs on after a call its caller
    gave up on (cancelled while the forward ran), whose result nobody reads. Without this, such
    a push left its outputs offered for good (a segment in /dev/shm, an allocation on a GPU)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the worker thread keeps, the event loop releases
        self._made: list[Outgoing] = []
        self._ended = False

    def keep(self, out: Outgoing) -> Outgoing:
        """`out`, made for this push: released with it, or now if it has ended."""
        with self._lock:
            if not self._ended:
                self._made.append(out)
                return out
        out.release()
        return out

    def release(self) -> None:
        with self._lock:
            self._ended, made, self._made = True, self._made, []
        for out in made:
            out.release()
