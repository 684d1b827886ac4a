"""A `Push` served here: the push data plane at one replica. The forward runs here, the outputs go
on to the next stage (`stage_server.replica.next_hop`) along the same call, and what comes back (the
gradient of the outputs, every later stage's receipt, the loss) gives this stage's backward and
the answer; the last stage runs its forward_backward instead. A validation microbatch goes the
same way, its loss back, nothing kept or accumulated.

The servicer (`stage_server.servicer`) decodes the request and encodes the answer; the backward
here is the replica's `Answering` (`stage_server.replica.answering`), which the servicer holds
too: the one way every accumulating call ends. The outputs sent on are encoded, their copy to the
host made, on the worker thread right after the forward (`Worker.run_then`): the event loop only
sends their bytes.

Where the job audits (`[trust] audit_fraction`), each microbatch leaves a record here
(`stage_server.replica.push_records`): the digests of what this replica received and sent, its
commitment, which the trainer asks for before it draws what to audit. Where the trainer can audit
nothing of a run (no stage of its path has a second replica) it sends it with `run` 0, and no
record is kept, no digest computed: nothing is paid for an audit that cannot run (issue 69)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch

from stage_server.replica.answering import Answered, Answering
from stage_server.replica.handing import Handing, Outgoing, Outgoings, reply_header
from stage_server.replica.lying import HONEST, Compute, Lies
from stage_server.replica.messages import Messages
from stage_server.replica.next_hop import Hop, NextHop, Pushed
from stage_server.replica.push_records import NO_RECORD, Arrived, PushRecords, Recording
from stage_server.replica.runtime import StageRuntime
from stage_server.replica.tensor_checks import Given
from stage_server.replica.worker import Worker
from swarm.errors import Busy
from swarm.job.rule import rule_of
from swarm.ops.faults import Point, maybe_die
from swarm.proto import stage_pb2 as pb
from swarm.proto import tensor_pb2
from swarm.rpc import epoch
from swarm.rpc.push_call import PushCall
from swarm.rpc.routes import check_route
from swarm.wire import chunking as wire
from swarm.wire import codec
from swarm.wire.crossing import Crossing

__all__ = ["PushPlane", "ServedPush"]

ServedPush = PushCall[torch.Tensor, torch.Tensor]
"""A push as this replica serves it: its tensors decoded."""


class PushPlane:
    """The pushes this replica serves, and the next stage it sends them on to (`NextHop`, anew
    for each stage `serve` installs)."""

    def __init__(
        self,
        *,
        peer: str,
        token: str | None,
        worker: Worker,
        messages: Messages,
        runtime: Callable[[], StageRuntime],
        answering: Answering,
        lies: Lies = HONEST,
    ) -> None:
        self.peer, self.token, self.worker = peer, token, worker
        self.messages, self.limits = messages, messages.limits
        self._runtime, self.answering, self._lies = runtime, answering, lies
        self._next_hop: Hop | None = None  # the push plane's next stage, as seen here
        self._served: Compute | None = None  # the served stage's compute, as this replica says
        # The records' digests, on a thread of their own: hashlib lets go of the GIL, so they
        # run beside the worker's compute, off the loop that relays other pushes (issue 69).
        # One thread: a microbatch's four digests take a few ms against its stage's tens.
        digester = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{peer}-digests")
        self.records = PushRecords(peer, lambda: self._runtime().activation_cache, digester)

    def serve(self, runtime: StageRuntime, job_id: str) -> None:
        """Send on to the stage after `runtime`'s, of job `job_id`."""
        self.release()
        self.records.clear()
        self.messages.handing.serve(runtime.device)
        # Its answers are bounded as this replica's requests are: the job within this peer's.
        next_hop = NextHop(
            self.limits.clamp(runtime.job),
            job_id,
            runtime.stage,
            self.token,
            handing=self.messages.handing,
        )
        # a liar's wrappers, installed once here (`stage_server.replica.lying`); honest: none
        self._next_hop, self._served = self._lies.hop(next_hop), self._lies.compute(runtime)

    def release(self) -> None:
        next_hop, self._next_hop, self._served = self._next_hop, None, None
        if next_hop is not None:  # its calls in flight end with their own deadlines
            asyncio.get_running_loop().create_task(next_hop.close())

    def _compute(self) -> Compute:
        assert self._served is not None  # a push reaches here only while a stage is served
        return self._served

    def room(self, h: pb.StagePushRequest) -> None:
        """From the header `h` of a push, before its body is read: Busy when `max_queue` pushed
        microbatches wait here already, or where this replica took a push of its run already
        (`PushRecords.check`); refused where it accumulates here without its lease's ticket
        (`Answering.check_lease`), and Busy where this replica holds the microbatch under
        another run (`Sums.check_run`), before any of its path's compute."""
        waiting = self.worker.waiting
        if waiting >= self.limits.max_queue:
            raise Busy(f"{self.peer}: {waiting} microbatches queued; try another replica")
        if h.evaluate:
            return
        if h.run:
            self.records.check(h.microbatch.step, h.microbatch.index, h.run)
        if self._runtime().stage in h.accumulate:
            self.answering.check_lease(h)
            # held here under another run: to another replica before anything after this stage
            # runs (the worker asks again as it accumulates)
            self._runtime().sums.check_run(h.microbatch.step, h.microbatch.index, h.run)

    async def push(
        self,
        h: pb.StagePushRequest,
        call: ServedPush,
        time_remaining: Callable[[], float | None],
        came: dict[str, Arrived] | None = None,
    ) -> pb.StagePushResponse:
        """The answer to `call`, request `h` (its microbatch id, the epoch it was leased in, a
        co-located caller's slot) with its tensors as they `came`; `time_remaining` is the
        caller's deadline, as the call's context tells it."""
        came = came or {}
        rt = self._runtime()
        check_route(call.route, rt.job.training.stages - rt.stage - 1)  # before it is followed
        # its push on carries the task's epoch and tickets (`swarm.rpc.epoch`)
        epoch.leased_in(h.microbatch.epoch, h.tickets)
        if rt.is_first:  # the token ids go on beside the outputs where the boundary needs them
            ids = call.crossing.hidden
            call = replace(call, crossing=Crossing(ids, rt.checks.boundary.tokens(ids)))
        maybe_die(Point.FORWARD, call.step)
        if call.evaluate:
            answer = await self._evaluation(call, time_remaining)
        else:
            record = self._record(call, came)
            try:
                reply = codec.codec_from_name(rt.job.compression.backward)
                slot = h.HasField("reply") and _slot_kept(record, self.messages.handing, reply)
                into = h.reply if slot else None
                here = _Here(h, reply, into, accumulate=rt.stage in call.accumulate)
                if rt.is_last:
                    answer = await self._last_stage(here, call, record, came)
                else:
                    answer = await self._through(here, call, time_remaining, record)
            except BaseException:
                try:
                    await record.settled()  # its digests read what came and went: before it goes
                finally:
                    self.records.drop(record)  # the run's retry here makes its own
                raise
            await record.settled()
        answer.site = self.messages.handing.site
        return answer

    async def _last_stage(
        self, here: _Here, call: ServedPush, record: Recording, came: dict[str, Arrived]
    ) -> pb.StagePushResponse:
        """The last stage: its forward_backward here, the loss and the input gradient back."""
        done = await self._backward_here(
            here, self._compute().forward_backward, call.crossing, call.targets, record
        )
        record.received("grad_outputs", call.targets, came.get("targets"))
        record.sent("outputs", lambda: torch.tensor(done.loss, dtype=torch.float64))
        record.sent("grad_inputs", lambda: _sent(done))
        return pb.StagePushResponse(
            tensors=done.grad,
            receipts=[done.receipt] if done.receipt is not None else [],
            loss_sum=done.loss,
            queued_seconds=done.queued,
        )

    async def _through(
        self,
        here: _Here,
        call: ServedPush,
        time_remaining: Callable[[], float | None],
        record: Recording,
    ) -> pb.StagePushResponse:
        """A stage before the last: the forward here and on to the next stage, then (where this
        stage accumulates, or its caller asked for the input gradient) the backward here with
        the gradient of its outputs that came back."""
        need_grad = here.accumulate or call.need_grad_inputs
        pushed, queued = await self._forward_on(
            call, time_remaining, need_grad, record, here.holder
        )
        receipts, grad = pushed.receipts, list[tensor_pb2.Tensor]()
        if need_grad:
            done = await self._backward_after(here, call, pushed, record)
            grad = done.grad
            if done.receipt is not None:
                receipts.append(done.receipt)
        return pb.StagePushResponse(
            tensors=grad,
            receipts=receipts,
            uncertain=sorted(pushed.uncertain),
            loss_sum=pushed.loss_sum,
            queued_seconds=queued,
            path=pushed.path,
        )

    async def _backward_after(
        self, here: _Here, call: ServedPush, pushed: Pushed, record: Recording
    ) -> Answered:
        """This stage's backward with the gradient of its outputs that came back (`pushed`):
        into this replica's slot (a tensor already), or a message, decoded here."""
        assert pushed.grad is not None
        grad_outputs, msg = pushed.grad, None
        if isinstance(grad_outputs, torch.Tensor):  # it came into this replica's slot
            dtype, shape = codec.dtype_name(grad_outputs.dtype), grad_outputs.shape
            header = reply_header(dtype, shape, here.reply, self.limits.block_size)
            self.messages.took(header, grad_outputs)
        else:
            msg = grad_outputs
            grad_outputs = await wire.decode_async(msg, max_bytes=self.limits.max_bytes)
            self.messages.took(msg, grad_outputs)
        record.received("grad_outputs", grad_outputs, msg)  # kept as it came
        done = await self._backward_here(
            here, self._compute().backward, call.crossing, grad_outputs, record
        )
        record.sent("grad_inputs", lambda: _sent(done))
        return done

    async def _backward_here(
        self,
        here: _Here,
        fn: Callable[..., tuple[Any, ...]],
        given: Given,
        other: torch.Tensor,
        record: Recording,
    ) -> Answered:
        """`fn` (the backward, or the last stage's forward_backward) of `inputs` and `other`
        (the gradient of the outputs, or the targets), answered as every accumulating call is
        (`Answering`): accumulated, with a receipt, where this stage accumulates. From here on
        `record` stays whatever follows (`PushRecords.drop`)."""
        record.backward_begins()
        return await self.answering.backward_here(
            fn,
            here.h,
            here.reply,
            given,
            other,
            accumulate=here.accumulate,
            receipt=here.accumulate,
            into=here.into,
            holder=here.holder,
        )

    async def _evaluation(
        self, call: ServedPush, time_remaining: Callable[[], float | None]
    ) -> pb.StagePushResponse:
        """A validation microbatch on the push plane: forward here, on to the next stage, the
        last stage's loss back; nothing kept, nothing accumulated."""
        rt = self._runtime()
        if rt.is_last:
            loss, queued = await self.worker.run_queued(
                self._compute().evaluate, call.step, call.crossing, call.targets
            )
            return pb.StagePushResponse(loss_sum=loss, queued_seconds=queued)
        pushed, queued = await self._forward_on(
            replace(call, accumulate=()), time_remaining, need_grad=False
        )
        return pb.StagePushResponse(loss_sum=pushed.loss_sum, queued_seconds=queued)

    async def _forward_on(
        self,
        call: ServedPush,
        time_remaining: Callable[[], float | None],
        need_grad: bool,
        record: Recording = NO_RECORD,
        holder: str = "",
    ) -> tuple[Pushed, float]:
        """Forward here, then on to the next stage (`NextHop`): what came back, and how long the
        forward waited for the worker."""
        rt, step, index = self._runtime(), call.step, call.index
        assert self._next_hop is not None
        sent_as = codec.codec_from_name(rt.job.compression.forward)  # as a trainer sends them
        # handed over to a co-located replica, on the wire to another: ready for both it may be
        near, far = self.messages.handing.forms(list(call.route[0].peers) if call.route else [])
        made = Outgoings()  # released when this push ends, however it ends

        def on_host(out: torch.Tensor) -> Outgoing:
            # On the worker thread: what it sends, and (where it keeps a record) what it commits
            # to: the same message. Its digest is taken on the record's digester, beside the
            # next computation.
            outgoing = made.keep(
                self.messages.hand_on(out, "inputs", sent_as, "forward", near, far)
            )
            record.sent("outputs", lambda: _kept(outgoing, self.messages.handing))
            return outgoing

        try:
            outputs, queued = await self.worker.run_then(
                self._compute().forward,
                on_host,
                step,
                index,
                call.crossing,
                evaluate=call.evaluate,
                holder=holder,
            )
            beside = self.messages.beside  # what goes on with the outputs: counted as sent too
            crossing = call.crossing.carrying(outputs).tokens_as(lambda t: beside(t, "tokens"))
            onward = call.onward(
                crossing,
                beside(call.targets, "targets"),
                after=rt.stage,
                need_grad_inputs=need_grad,
            )
            pushed = await self._next_hop.send(onward, deadline=_deadline(time_remaining(), rt))
        finally:
            made.release()  # every try ended (or the call did): no replica reads them now
        return pushed, queued

    def _record(self, call: ServedPush, came: dict[str, Arrived]) -> Recording:
        """A new record of `call`'s microbatch, with what came in; none (`NO_RECORD`) where the
        job audits nothing (no fraction, or local steps: replicas differ, nobody can redo their
        work) or the trainer audits nothing of this run (`run` 0: no stage of its path has another
        replica to redo its work, `client.audit.push_audit.PushAudits.run_id`; issue 69).
        It keeps each as it `came` (the first stage's token ids, made here: decoded)."""
        rt = self._runtime()
        if not call.run or not rt.job.trust.audit_fraction or rule_of(rt.job).rounds:
            return NO_RECORD
        record = self.records.begin(rt.stage, call.step, call.index, call.run)
        rt.copies.recorded(call.step)  # its audit may end after its step commits (`prior_params`)
        self.messages.metrics.recorded()
        record.received("inputs", call.crossing.hidden, came.get("inputs"))
        tokens = None if rt.is_first else call.crossing.tokens  # the first stage's: none kept
        record.received("tokens", tokens, came.get("tokens"))
        record.received("targets", call.targets, came.get("targets"))
        return record


@dataclass(frozen=True)
class _Here:
    """How this replica answers a push's backward here: request `h` (its microbatch, the epoch
    it was leased in), its input gradient in codec `reply` (into a co-located caller's slot
    `into`, where there is one), accumulated with a receipt where `accumulate`."""

    h: pb.StagePushRequest
    reply: int
    into: tensor_pb2.Handover | None
    accumulate: bool

    @property
    def holder(self) -> str:
        """Whose activations its forward keeps: this call's, by its request (another's Push or
        Forward of the microbatch keeps its own: `stage_server.replica.activation_cache`)."""
        return f"push {id(self.h)}"


def _slot_kept(record: Recording, handing: Handing, reply: int) -> bool:
    """Whether a co-located caller's slot takes the gradient of a push with `record`: always
    where none is kept. Where one is, through shared memory in no codec (issue 69: on the wire,
    the gradient's bytes were the records' price on every co-located hop): both sides' records
    then keep the same bytes (this one the payload written there, `_sent`; the caller the tensor
    it read from it, its own copy, which is that payload). Elsewhere the gradient goes in the
    message, as a record keeps it: a device's payload would be copied to the host on the event
    loop, the caller's read of a CUDA slot is the slot itself (a record would hold what a share
    made), and the caller would keep a lossy one decoded, widened, for the trainer to fetch."""
    shm = handing.handover is not None and handing.handover.kind == "shm"
    return not record.kept or (shm and reply == codec.CODEC_NONE)


def _sent(done: Answered) -> tensor_pb2.Tensor | Arrived | None:
    """The input gradient sent back as a record keeps it: its message, or, written into the
    caller's slot, the payload written there (none asked for: nothing)."""
    if not done.grad:
        return None
    if done.filled is not None:  # on the host: shared memory's (`_slot_kept`)
        return Arrived.of(done.grad[0], done.filled)
    return done.grad[0]


def _kept(outgoing: Outgoing, handing: Handing) -> tensor_pb2.Tensor | Arrived:
    """The outputs sent on as a record keeps them (on the worker thread): their message where
    one was made (a try went on the wire, or they are on a device: a record holds host bytes),
    else the payload handed over, on the host: no message made for the record alone (issue 69:
    its copies were the records' price on every co-located hop). The payload itself where the
    handover offered a copy of it (shared memory); a copy of it where the offer shares its own
    memory (CUDA IPC's logic, on its CPU stand-in): a record never holds what a share made."""
    wire, payload = outgoing.made_wire, outgoing.payload
    if wire is not None or payload.device.type != "cpu":
        return outgoing.wire()
    copied = handing.handover is not None and handing.handover.kind == "shm"
    return Arrived.of(outgoing.header, payload if copied else payload.clone())


def _deadline(left: float | None, rt: StageRuntime) -> float:
    """Leave this stage's backward and the answer a share of the caller's deadline (`left`
    seconds; None: the caller set none)."""
    return time.monotonic() + (left or rt.job.runtime.rpc_timeout_s) * 0.9
