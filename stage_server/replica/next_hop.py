"""The push data plane's next hop: a replica sends its outputs straight to a replica of the next
stage (`Push`), chosen as a trainer chooses, and collects what comes back along the same call
(the gradient of its outputs, every later stage's receipt, the loss).

Who to send to: the least-loaded healthy replica among those the request's route names, by the
smallest expected finish time (`swarm.policy.wiring`, fed by this replica's own in-flight calls
and measured service times). A replica that answers busy gets the next try elsewhere and is not
banned; one that fails is banned with backoff and the hop is tried on another. One that refuses
what was handed over to it (`HandoverRefused`: it took nothing) is not at fault either: within
the same try the same push goes to it again on the wire, and its site is forgotten
(`stage_server.replica.handing`).

Exactness: a failed call may have accumulated downstream all the same (it died after the
backward, say). Its stages are never asked to accumulate again from here: the later tries only
fetch the gradient this replica needs, and those stages go back to the trainer as `uncertain`:
the coordinator adopts the receipts a replica holds, or replays the stage (as it does for an
uncertain call of the carry plane).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from stage_server.replica.handing import Handing, Outgoing
from swarm.clock import MonotonicClock
from swarm.errors import Busy, HandoverRefused, PeerUnavailable
from swarm.job.config import JobConfig
from swarm.policy.wiring import Wiring
from swarm.proto import stage_pb2 as pb
from swarm.proto import tensor_pb2
from swarm.rpc.hop import HopFailed, Hopped, any_error, hop
from swarm.rpc.push_call import PushCall
from swarm.rpc.routes import ClientFactory, Routes, members_of
from swarm.rpc.stage_client import PushResult, StageClient, TensorLike, named
from swarm.wire import codec

__all__ = ["Hop", "NextHop", "Onward", "Pushed"]

Onward = PushCall[TensorLike | Outgoing, TensorLike]
"""A push as a replica sends it on: its outputs as it hands them on (`Outgoing`, on the host or
handed over per try), or a message already."""


@dataclass
class Pushed:
    """What came back from the stages after this one."""

    grad: TensorLike | None  # the gradient of this stage's outputs (when asked for)
    receipts: list[pb.Receipt] = field(default_factory=list)
    uncertain: set[int] = field(default_factory=set)
    loss_sum: float = 0.0
    path: list[str] = field(default_factory=list)  # the replica of each later stage it went to


class Hop(Protocol):
    """Where a replica's push plane sends its outputs on: `NextHop`, or a liar's wrapper of it
    (`stage_server.replica.lying`)."""

    async def send(self, call: Onward, *, deadline: float) -> Pushed: ...

    async def close(self) -> None: ...


class NextHop:
    """The stage after this replica's as it sees it: a pool and a client per replica, following
    the routes requests carry (`swarm.rpc.routes`), and the one hop loop (`swarm.rpc.hop`)."""

    def __init__(
        self,
        job: JobConfig,
        job_id: str,
        stage: int,
        token: str | None,
        attempts: int = 4,
        client_factory: ClientFactory = StageClient,
        handing: Handing | None = None,
    ) -> None:
        self.job, self.stage, self.attempts = job, stage, attempts
        self.handing = handing  # None: every push goes on the wire
        wiring = Wiring(
            job.training.stages,
            clock=MonotonicClock(),
            rng=random.Random(),
            task_samples=job.training.microbatch_size,
        )
        self.routes = Routes(job, job_id, token, wiring, client_factory)

    async def send(self, call: Onward, *, deadline: float) -> Pushed:
        """Send `call` (this stage's outputs as they cross) on to the next stage, a replica of
        `call.route[0]` (tries on others as above; a replica hands its outputs over encoded, on
        the host already, so no try waits on its device); raises `PeerUnavailable` when no
        replica of it gave what this replica needs (the gradient where `need_grad_inputs`, the
        loss of a validation microbatch)."""
        stage = self.stage + 1
        if not call.route:
            raise PeerUnavailable(f"stage {stage}: the request named no replica of it")
        self.routes.follow(stage, members_of(call.route[0]))
        tries = _Tries(self, call, deadline)
        try:
            done = await hop(
                self.routes,
                stage,
                tries.one,
                attempts=self.attempts,
                accumulate=bool(call.accumulate),
                need_result=call.need_grad_inputs or call.evaluate,
                deadline=deadline,
                landed=any_error,  # what it passed on before failing may have accumulated
            )
        except HopFailed as e:
            raise PeerUnavailable(f"no replica took the microbatch: {e}") from e
        return _came_back(done, call.accumulate, stage)

    async def close(self) -> None:
        await self.routes.close()


class _Tries:
    """One send's tries, each on a replica the hop chose: its outputs handed over where that
    replica shares this one's site, else on the wire, with a slot for the gradient (the
    try's own) where it is handed over."""

    def __init__(self, next_hop: NextHop, call: Onward, deadline: float) -> None:
        self.next_hop, self.call, self.deadline = next_hop, call, deadline
        self.handing, job = next_hop.handing, next_hop.job
        self.reply = codec.codec_from_name(job.compression.backward)  # the gradient's codec
        self.block_size = job.compression.block_size

    async def one(self, client: StageClient, accumulating: bool) -> PushResult:
        """One try on `client`'s replica; its answer names the site it learns."""
        clients = self.next_hop.routes.clients.made().items()  # the hop made it to call
        peer = next((p for p, c in clients if c is client), "")
        outputs = self.call.crossing.hidden
        if isinstance(outputs, Outgoing):  # per hop: to a co-located replica, or the wire
            result = await self._hand(client, peer, outputs, accumulating)
        else:
            result = await self._push(client, outputs, accumulating)
        if self.handing is not None:
            self.handing.learned(peer, result.site)
        return result

    async def _hand(
        self, client: StageClient, peer: str, out: Outgoing, accumulating: bool
    ) -> PushResult:
        """A push of `out` to `peer`: handed over where it shares this replica's site, and
        on the wire, within the same try, where it refuses what was handed over."""
        handing = self.handing
        handed = out.handed() if handing is not None and handing.near(peer) else None
        if handed is None:  # another site, or this replica could not offer them
            return await self._push(client, out.wire(), accumulating)
        try:
            result = await self._push(client, handed, accumulating)
        except HandoverRefused as e:
            # It took nothing (it refused while it read the request): the same push to the
            # same replica on the wire; nothing counts against it, as the hop sees success.
            # (Their copy to the host is made here, on the loop: once a refusing replica.)
            assert handing is not None
            handing.refused(peer, e)
            return await self._push(client, out.wire(), accumulating)
        except Busy:
            raise  # turned away before it read the handle
        except BaseException:
            out.taken()  # it may have taken them before the call failed
            raise
        out.taken()
        return result

    async def _push(self, client: StageClient, sent: TensorLike, accumulating: bool) -> PushResult:
        """One push of `sent` to `client`; with a slot for the gradient (this try's own)
        when `sent` is handed over."""
        slot = None
        if self.call.need_grad_inputs and self.handing is not None and _handed_over(sent):
            assert isinstance(sent, tensor_pb2.Tensor)
            slot = self.handing.slot(sent, self.reply, self.block_size)
        mapped = False  # whether the replica wrote into the slot, or may have
        try:
            result = await client.push(
                self.call.carrying(sent).past(accumulating),
                timeout=self.deadline - time.monotonic(),
                reply=slot,
            )
            # a gradient that came into the slot is a tensor; one with its bytes, a message
            mapped = isinstance(result.grad_inputs, torch.Tensor)
            return result
        except (Busy, HandoverRefused):
            raise  # turned away before it was answered: nobody mapped the slot
        except BaseException:
            mapped = True  # failed after it may have written it
            raise
        finally:
            if slot is not None:  # this try's own: a later try gets another
                if not mapped:
                    slot.unused()
                slot.release()


def _came_back(done: Hopped[PushResult], accumulate: tuple[int, ...], stage: int) -> Pushed:
    """What the hop's answer (if any) brought back. Stages it asked to accumulate at, and may
    have, but cannot say it did: uncertain."""
    uncertain = set(accumulate) if accumulate and not done.accumulated else set()
    if done.result is None:
        return Pushed(None, [], uncertain)
    result, peer = done.result, done.peer
    assert peer is not None
    return Pushed(
        result.grad_inputs,
        named(result.receipts, stage, peer),
        uncertain | set(result.uncertain),
        result.loss_sum,
        [peer, *result.path],
    )


def _handed_over(sent: TensorLike) -> bool:
    """Whether `sent` names a handover rather than carrying its bytes."""
    return isinstance(sent, tensor_pb2.Tensor) and sent.HasField("handover")
