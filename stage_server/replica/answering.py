"""How a call that accumulates here is answered: the one way every such call ends (Backward,
ForwardBackward, and a Push at each stage it accumulates at). Compute on the replica's worker,
then the BACKWARD fault point (accumulated, not yet answered: the case a replay must cover), then
the input gradient and the receipt.

One `Answering` per replica, held by the servicer (`stage_server.servicer`) and the push plane
(`stage_server.push`) alike, so neither calls into the other."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from stage_server.replica.in_flight import InFlight
from stage_server.replica.messages import Messages
from stage_server.replica.runtime import Receipt, StageRuntime
from stage_server.replica.tensor_checks import Given
from stage_server.replica.worker import Worker
from swarm.errors import PermissionDenied
from swarm.net.lease_tickets import LeaseTickets
from swarm.ops.faults import Point, maybe_die
from swarm.proto import stage_pb2 as pb
from swarm.proto import tensor_pb2

T = TypeVar("T")

__all__ = ["Answered", "Answering"]


@dataclass(frozen=True)
class Answered:
    """A backward done here, ready for the answer."""

    grad: list[tensor_pb2.Tensor]  # the encoded input gradient ([] when none was asked for)
    receipt: pb.Receipt | None  # None when the caller keeps no receipt
    loss: float  # the loss sum of a forward_backward (0.0 for a backward)
    queued: float  # seconds the call waited for the worker
    digest: pb.SumCheck | None = None  # an audit's: its gradient's (`digest_seed`)
    #: the input gradient's payload as written into the caller's slot (None: it is in `grad`'s
    #: message): what the caller decodes, which a push's record keeps (`stage_server.push`)
    filled: torch.Tensor | None = None

    def answer(self) -> dict[str, Any]:
        """The fields a Backward's or ForwardBackward's answer takes from it."""
        return {
            "tensors": self.grad,
            "receipt": self.receipt,
            "queued_seconds": self.queued,
            "digest": self.digest,
        }


class Answering:
    """The backward here of whichever stage `runtime()` serves, answered as replica `peer`."""

    def __init__(
        self,
        *,
        peer: str,
        worker: Worker,
        messages: Messages,
        runtime: Callable[[], StageRuntime],
        tickets: Callable[[], LeaseTickets | None] = lambda: None,
    ) -> None:
        """`tickets()`: what an accumulation's lease ticket is checked against (None: no
        scheduler placed this replica, and the token is enough: `swarm.net.lease_tickets`)."""
        self.peer, self.worker, self.messages = peer, worker, messages
        self._runtime, self._tickets = runtime, tickets

    def run(self, h: Any) -> Callable[..., Awaitable[tuple[Any, float]]]:
        """How the call of header `h` takes the worker: ahead of the calls queued in turn where
        it is the re-execution of an audit that gates its microbatch's report (`Worker.run_ahead`,
        issue 69: the step's commit waits for it), else in turn. A late audit's (`h.late`: its
        microbatch reported already, `client.audit.late_audits`) has until the step after next
        is given out; ahead, it would hold up the pushes of the step being trained. The trainer
        says which: a false word only moves its own audit in this queue."""
        ahead = self.redoes(h) and not h.late
        return self.worker.run_ahead if ahead else self.worker.run_then

    def redoes(self, h: Any) -> bool:
        """Whether the call of header `h` is an audit's re-execution. On the push plane, whose
        training and evaluation go through Push alone, a Backward is one, and a Forward or a
        ForwardBackward that does not evaluate (on the relay plane they train)."""
        if isinstance(h, pb.StageBackwardRequest):
            redo = True
        elif isinstance(h, (pb.StageForwardRequest, pb.StageForwardBackwardRequest)):
            redo = not h.evaluate
        else:  # a Push's, at a stage of its path
            redo = False
        return redo and self._runtime().job.runtime.data_plane == "push"

    def computing(self, h: Any, fn: Callable[..., T]) -> Callable[..., T]:
        """`fn`, the compute of the call of header `h`, as the worker runs it: a re-execution
        (`redoes`) may compute on the step before's parameters where they are kept for its
        late audits (`stage_server.replica.prior_params`, issue 69)."""
        if not self.redoes(h):
            return fn
        prior = self._runtime().copies

        @functools.wraps(fn)  # named as `fn` is (the benches' timeline: `swarm.ops.timeline`)
        def redoing(*args: Any, **kwargs: Any) -> T:
            with prior.redoing():
                return fn(*args, **kwargs)

        return redoing

    def check_lease(self, h: Any) -> None:
        """PermissionDenied unless the call of header `h`, which accumulates here, carries the
        scheduler's lease ticket of its microbatch at this stage (`swarm.net.lease_tickets`),
        where this replica knows the scheduler's key. On the push plane a stage accumulates
        only in the push that did its forward here: an accumulating Backward or
        ForwardBackward there is no honest trainer's, whatever it carries."""
        tickets = self._tickets()
        if tickets is None:  # no scheduler placed it: the token is enough
            return
        rt, mb, run = self._runtime(), h.microbatch, 0
        if isinstance(h, pb.StagePushRequest):
            # Its run too: a replica ahead of this stage on the route holds this stage's ticket,
            # and under a run of its own would accumulate here ahead of the lessee's push.
            ticket, run = h.tickets[rt.stage] if rt.stage < len(h.tickets) else b"", h.run
        elif rt.job.runtime.data_plane == "push":
            raise PermissionDenied(
                f"{self.peer}: microbatch ({mb.step}, {mb.index}): on the push plane a stage "
                "accumulates only in the push that did its forward; an accumulating "
                f"{'Backward' if isinstance(h, pb.StageBackwardRequest) else 'ForwardBackward'}"
                " is refused (an audit's re-execution does not accumulate)"
            )
        else:
            ticket = mb.ticket
        tickets.check(h.job, mb.step, mb.index, mb.epoch, rt.stage, run, ticket)

    def _receipt(self, r: Receipt) -> pb.Receipt:
        return self.messages.receipt(r, self.peer, len(self._runtime().receipts()))

    def _admitted(
        self, h: Any, fn: Callable[..., tuple[Any, ...]], flight: InFlight | None
    ) -> Callable[..., tuple[Any, ...]]:
        """`fn`, the compute of the call of header `h`, as the worker runs it: admitted under the
        rollback epoch (`swarm.rpc.epoch`: work leased before a rollback that lands after its
        state load is refused, not added to the replayed step), with its entry in flight held
        while it runs."""
        step, index = h.microbatch.step, h.microbatch.index
        computed = self.computing(h, fn)

        @functools.wraps(fn)  # named as `fn` is (the benches' timeline: `swarm.ops.timeline`)
        def admitted(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
            if flight is not None:
                flight.started()
            try:
                self._runtime().sums.admit(h.microbatch.epoch, step, index)
                return computed(*args, **kwargs)
            finally:
                if flight is not None:
                    flight.ended()

        return admitted

    async def backward_here(
        self,
        fn: Callable[..., tuple[Any, ...]],
        h: Any,
        reply: int,
        given: Given | None,
        grad_outputs: torch.Tensor,
        *,
        accumulate: bool,
        receipt: bool = True,
        into: tensor_pb2.Handover | None = None,
        digest_seed: int = 0,
        holder: str = "",
    ) -> Answered:
        """The one way a call accumulates here: `fn` (the replica's compute's `backward`, or the
        last stage's `forward_backward`: `stage_server.replica.lying.Compute`) of `h`'s
        microbatch on the worker, from what crossed in (`given`; None: the activations cached
        here) and `grad_outputs` (the last stage's: the targets), the BACKWARD fault point, then
        the input gradient in codec `reply` (into a co-located caller's slot `into`, when it
        opens: `stage_server.replica.handing`) and (unless `receipt` is False) the receipt; ahead of
        the calls queued where it is an audit's re-execution (`run`). `holder`: whose Forward's
        activations it may use (`stage_server.replica.activation_cache`)."""
        step, index = h.microbatch.step, h.microbatch.index
        run = h.run if isinstance(h, pb.StagePushRequest) else 0
        if accumulate:  # before it takes the worker
            self.check_lease(h)

        def on_host(
            result: tuple[Any, ...],
        ) -> tuple[list[float], list[Any], Receipt, torch.Tensor | None]:
            # On the worker thread: the input gradient's copy to the host waits on the device.
            *loss, grad, done = result
            if grad is None:
                return loss, [], done, None
            msg, filled = self.messages.encode_one(grad, "grad_inputs", reply, "backward", into)
            return loss, [msg], done, filled

        # Named in Info until its compute has ended (`stage_server.replica.in_flight`): a late
        # receipt's microbatch is not leased again meanwhile
        flight = self._runtime().in_flight.enter(step, index, run) if accumulate else None
        try:
            (loss, grad, done, filled), queued = await self.run(h)(
                self._admitted(h, fn, flight),
                on_host,
                step,
                index,
                given,
                grad_outputs,
                accumulate=accumulate,
                need_grad_inputs=h.need_grad_inputs,
                # an audit of a contribution (`stage_server.replica.gradient_digest`)
                digest_seed=digest_seed,
                holder=holder,
                # the push's run, which its receipt is held under (`StepSums.other_run`)
                run=run,
            )
        finally:
            if flight is not None:
                flight.abandoned()  # where its compute never started: it never will
        maybe_die(Point.BACKWARD, step)  # accumulated, not yet answered
        digest = done.digest  # an audit's (`stage_server.replica.gradient_digest`)
        return Answered(
            grad=grad,
            receipt=self._receipt(done) if receipt else None,
            loss=loss[0] if loss else 0.0,
            queued=queued,
            digest=None
            if digest is None
            else pb.SumCheck(dot=digest[0], magnitude=digest[1], norm=digest[2]),
            filled=filled,
        )
