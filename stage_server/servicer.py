"""`StageService` over a `StageRuntime`: decode and encode (`stage_server.replica.messages`), check
the route, run the compute on the replica's worker (`stage_server.replica.worker`). Push goes to
`stage_server.replica.push`; Commit and Discard to `stage_server.replica.commit`; Join, Updates,
LoadState and DownloadState to `stage_server.replica.state_transfer`.
Errors become status codes in `swarm.rpc.servicing`, as in every servicer; a bad request never
takes the server down.

Every call that accumulates here (Backward, ForwardBackward, Push) ends the same way, in the
replica's one `Answering` (`stage_server.replica.answering`), which the push plane holds too.

A data-plane call is routed, and a full replica says Busy, from the request's header, before a
byte of its body is allocated; the body's bytes come from the process's receive budget
(`swarm.wire.budget`, shared with the pool's averaging and LoadState) and are held until the call
ends: past the budget the call is Busy too, and goes to another replica."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import grpc
import torch
from google.protobuf.message import Message

from stage_server.averaging.channels import ChannelPool
from stage_server.averaging.error_feedback import ErrorFeedback
from stage_server.averaging.owner import Averager
from stage_server.peer.limits import PeerLimits
from stage_server.peer.metrics import StageMetrics
from stage_server.replica.answering import Answering
from stage_server.replica.commit import Commit, Committer
from stage_server.replica.lying import Compute, lies_of
from stage_server.replica.messages import Limits, Messages, info_reply
from stage_server.replica.push import PushPlane
from stage_server.replica.push_records import Arrived
from stage_server.replica.runtime import StageRuntime
from stage_server.replica.state_transfer import StateTransfer
from stage_server.replica.worker import Worker
from swarm.device.compute_clock import clock_for
from swarm.device.host_copies import HostCopies
from swarm.errors import Busy, NotFound, SwarmError
from swarm.net.commit_auth import STATE_DIGEST_KEY, CommitRefused, CommitVerifier
from swarm.net.lease_tickets import LeaseTickets
from swarm.net.refused_streams import RefusedStreams
from swarm.net.told_ahead import refuse
from swarm.ops.faults import Point, maybe_die
from swarm.ops.poison import Poison
from swarm.ops.rated import RatedLog
from swarm.proto import control_pb2 as cpb
from swarm.proto import stage_pb2 as pb
from swarm.proto import stage_pb2_grpc
from swarm.rpc.push_call import PushCall
from swarm.rpc.reader_idle import READER_IDLE_S, taken_within
from swarm.rpc.servicing import Servicing
from swarm.wire.budget import Held, ReceiveBudget
from swarm.wire.chunking import (
    TENSOR_OVERHEAD_BYTES,
    grpc_options,
    read_to_end,
    within_deadline,
)
from swarm.wire.crossing import Crossing

__all__ = ["StageServicer"]

T = TypeVar("T")
log = logging.getLogger(__name__)

#: Longest a refused LoadState is read before its refusal (seconds): its client, which has the
#: swarm token, writes the whole state, then reads; and how many are read at once.
REFUSED_READ_S = 10.0
REFUSED_AT_ONCE = 2
#: Longest a data-plane call refused Busy is read before its refusal (seconds), and how many at
#: once: its client writes one microbatch, then half-closes; the read drops each message as it
#: comes (one at most held a stream, within the message limit) and holds none of the budget.
BUSY_READ_S = 2.0
BUSY_AT_ONCE = 4


class StageServicer(stage_pb2_grpc.StageServiceServicer):
    """Serves whichever stage `serve` last installed; until then every call is NOT_FOUND."""

    def __init__(
        self,
        *,
        peer: str,
        metrics: StageMetrics,
        executor: ThreadPoolExecutor,
        throttle: float = 1.0,
        token: str | None = None,
        limits: PeerLimits | None = None,
        spill_dir: Path | None = None,
        poison: Poison | None = None,  # its lies (tests: `swarm.ops.poison`); None: SWARM_FAULTS'
    ) -> None:
        self.peer, self.metrics = peer, metrics
        self.job_id = ""
        # The scheduler's key, once a scheduler assigned this peer its stage (the agent sets
        # it): the commit protocol's calls are then taken only signed with it. None: a server
        # whose owner coordinates it (`swarm trainer --stage-servers`): the token alone.
        self.commit_auth: CommitVerifier | None = None
        # of the same key: whose lease tickets an accumulation needs (`swarm.net.lease_tickets`)
        self.lease_tickets: LeaseTickets | None = None
        self._refusals = RatedLog(log)
        # A refused LoadState is read to its client's half-close before the refusal is sent.
        self._refused_streams = RefusedStreams(
            total_s=REFUSED_READ_S, idle_s=None, at_once=REFUSED_AT_ONCE
        )
        # So is a data-plane call refused Busy from its header or mid-body (`_receive`).
        self.busy_streams = RefusedStreams(total_s=BUSY_READ_S, idle_s=None, at_once=BUSY_AT_ONCE)
        self._runtime: StageRuntime | None = None
        self._compute: Compute | None = None  # the runtime's, or a liar's wrapper of it
        self.token = token
        self.limits = Limits(limits or PeerLimits())  # the served job's, within this peer's
        # The bodies of the requests this process holds at once (the pool's averaging too).
        self.budget = ReceiveBudget(self.limits.peer.receive_budget_bytes)
        self._messages = Messages(self.limits, metrics)
        self.worker = Worker(executor, metrics.queue, throttle)
        self.averager = Averager()
        self.channels = ChannelPool(
            token=token, options=grpc_options(self.limits.peer.max_message_bytes), link=metrics.link
        )
        self._serving = Servicing(peer, metrics.observe)
        self._commits = Committer(
            peer=peer,
            worker=self.worker,
            metrics=metrics,
            averager=self.averager,
            channels=self.channels,
            limits=self.limits,
            runtime=lambda: self.runtime,
            spill_dir=spill_dir,
        )
        self._transfer = StateTransfer(
            peer=peer,
            token=token,
            worker=self.worker,
            metrics=metrics,
            runtime=lambda: self.runtime,
            budget=self.budget,
            limits=self.limits,
            # Under a scheduler, it alone names followers (its tickets, issue 44 N7).
            scheduler_key=lambda: self.commit_auth.public if self.commit_auth else None,
        )
        # a hostile replica's lies that audits must catch, for tests (`replica.lying`)
        self._lies = lies_of(Poison.armed() if poison is None else poison)
        self._answering = Answering(
            peer=peer,
            worker=self.worker,
            messages=self._messages,
            runtime=lambda: self.runtime,
            tickets=lambda: self.lease_tickets,
        )
        self._push = PushPlane(
            peer=peer,
            token=token,
            worker=self.worker,
            messages=self._messages,
            runtime=lambda: self.runtime,
            answering=self._answering,
            lies=self._lies,
        )

    # The worker's figures and the feedback, where the agent and tests read them.
    @property
    def throttle(self) -> float:  # >1 stands in for a slower device (`Worker.throttle`)
        return self.worker.throttle

    @throttle.setter
    def throttle(self, value: float) -> None:
        self.worker.throttle = value

    @property
    def copies(self) -> HostCopies:
        """How replies reach the host (`swarm.device.host_copies`)."""
        return self._messages.copies

    @copies.setter
    def copies(self, value: HostCopies) -> None:
        self._messages.copies = value

    @property
    def waiting(self) -> int:  # compute calls queued or running: the load this peer reports
        return self.worker.waiting

    @property
    def ema_seconds(self) -> float | None:  # moving average of one compute call (seconds)
        return self.worker.ema_seconds

    @property
    def _feedback(self) -> ErrorFeedback:  # what lossy averaging dropped, for the next round
        return self._commits.feedback

    def serve(
        self, runtime: StageRuntime, job_id: str, announced: cpb.JobAnnouncement | None = None
    ) -> None:
        """Start serving `runtime` as job `job_id` (called on the event loop between calls);
        `announced`: the job's announcement, by its scheduler (`trust`)."""
        if self._runtime is not runtime:  # a move: the stage served until now goes
            self._let_go()
        self._runtime, self.job_id = runtime, job_id
        self._compute = self._lies.compute(runtime)  # a liar's wrapper over it, once
        self.trust(announced)
        self._commits.serve()  # a state installed anew starts from no residuals
        self.limits.serve(runtime.job)
        self.limits.bound(runtime)
        runtime.checks.to_device = lambda t, d: self.copies.to_device(t, d)  # their own stream
        self.worker.clock = clock_for(runtime.device)  # compute timed to its end on the device
        self.metrics.bind(job_id, runtime.stage)
        self._push.serve(runtime, job_id)

    def trust(self, announced: cpb.JobAnnouncement | None) -> None:
        """Take the commit protocol's calls only signed with the key the scheduler announced the
        served job with (`swarm.net.commit_auth`); another job's announcement changes nothing."""
        if announced is None or announced.job != self.job_id:
            return
        key = announced.scheduler_key
        if self.commit_auth is None or self.commit_auth.public != key:
            self.commit_auth = CommitVerifier(key, self.peer) if key else None
            self.lease_tickets = LeaseTickets(key, self.peer) if key else None

    def release(self) -> None:
        """Stop serving: later calls are NOT_FOUND until the next `serve`."""
        self._let_go()
        self._runtime, self._compute, self.job_id = None, None, ""
        self.limits.release()  # its activation window's part of the device, for the others
        self._transfer.stop_copy()
        self._push.release()

    def _let_go(self) -> None:
        """The stage served until now is no longer (moved, released, its job ended): its spill
        file closes now, not when its idle timer fires, and what its lossy averaging kept for
        the next round goes, not at the next stage's `serve`. Its runtime goes with the last
        reference: a call under way ends with it."""
        if self._runtime is not None:
            self._runtime.sums.close()
        self._commits.serve()  # no residuals: those were of the stage let go

    def stopped(self) -> None:
        """The server stopped: the served stage's spill file closes now (its runtime stays, for
        whoever reads its state after)."""
        if self._runtime is not None:
            self._runtime.sums.close()

    @property
    def runtime(self) -> StageRuntime:
        if self._runtime is None:
            raise NotFound(f"peer {self.peer} serves no stage yet")
        return self._runtime

    @property
    def compute(self) -> Compute:  # the served stage's, as this replica says it computed
        assert self._compute is not None  # a data-plane call is routed (`_route`) before
        return self._compute

    # -- plumbing -------------------------------------------------------------------------------
    def _route(self, job: str, stage: int) -> None:
        if self._runtime is None or job != self.job_id:
            raise NotFound(f"unknown job {job!r}; this server serves job {self.job_id!r}")
        if stage != self.runtime.stage:
            raise NotFound(
                f"stage {stage} is not served here; this server serves stage {self.runtime.stage}"
            )

    async def _receive(
        self,
        requests: AsyncIterator[Any],
        held: Held,
        admit: Callable[[Any], None] | None = None,
        handed: bool = False,  # a Push: its tensors may be handed over (`replica.handing`)
    ) -> tuple[Any, dict[str, torch.Tensor], dict[str, Arrived]]:
        # A caller with no deadline must not hold its body's share of the budget forever.
        timeout = self.runtime.job.runtime.rpc_timeout_s
        body = within_deadline(requests, timeout, "the job's runtime.rpc_timeout_s")
        # The most one microbatch's two tensors take, with what each is charged beyond its bytes.
        # (three under a subspace boundary: the token ids travel beside them)
        most = self.runtime.checks.max_request_bytes() + 3 * TENSOR_OVERHEAD_BYTES
        try:
            received = await self._messages.receive(body, most, self._route, held, admit, handed)
        except Busy as busy:
            # Its client is still writing the body: read to its half-close before the refusal,
            # or grpc-aio may tell it INTERNAL in its place (`swarm.net.refused_streams`).
            held.release()  # nothing of the budget held meanwhile; what is read is dropped
            await self.busy_streams.after(busy, body)
            raise
        # A caller closes its side before it waits for the answer: its end is here already,
        # and read, gRPC lets go of the request's last chunk now (`read_to_end`).
        await read_to_end(body, "the request's")
        return received

    async def _run_held(
        self,
        method: str,
        context: grpc.aio.ServicerContext,
        body: Callable[[Held], Awaitable[T]],
    ) -> T:
        """`body` run as `Servicing.run` does, holding the bytes it receives (Busy past the
        process's budget) until it is done."""

        async def held_body() -> T:
            with self.budget.hold(Busy) as held:
                return await body(held)

        return await self._serving.run(method, context, held_body)

    async def _answered(
        self,
        method: str,
        context: grpc.aio.ServicerContext,
        body: Callable[[Held], Awaitable[Message]],
    ) -> AsyncIterator[Any]:
        """`body`'s answer (run as `_run_held` runs it), in chunks. Its bytes are held in the
        receive budget, whatever is free (they are made), until its reader has taken it, and a
        reader that takes no chunk within the job's `rpc_timeout_s` is let go
        (`taken_within`). Before, a caller that half-closed and never read kept a microbatch's
        outputs (a record's tensors) for as long as its connection lived, outside every bound."""
        with self.budget.hold(Busy) as sending:
            answer = await self._run_held(method, context, body)
            sending.charge(answer.ByteSize())
            rt = self._runtime
            stall_s = READER_IDLE_S if rt is None else rt.job.runtime.rpc_timeout_s
            for part in self._messages.split(answer):
                with taken_within(stall_s, f"{self.peer}: {method}"):
                    yield part

    # -- the data plane -------------------------------------------------------------------------
    async def Forward(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        async def body(held: Held) -> pb.StageForwardResponse:
            h, tensors, _ = await self._receive(request_iterator, held)
            (inputs,) = self._messages.need(tensors, "inputs")
            given = Crossing(inputs, tensors.get("tokens"))  # a subspace boundary's ids beside
            reply = self._messages.reply_codec(h.reply_codec)
            step, index = h.microbatch.step, h.microbatch.index
            maybe_die(Point.FORWARD, step)
            await self._commits.before(step)  # the step before's APPLY, if it is on its way
            # The outputs' copy to the host on the worker thread, right after the compute.
            outputs, queued = await self._answering.run(h)(
                self._answering.computing(h, self.compute.forward),
                lambda out: self._messages.encode(out, "outputs", reply, "forward"),
                step,
                index,
                given,
                evaluate=h.evaluate,
                holder=_caller(context),
            )
            return pb.StageForwardResponse(tensors=outputs, queued_seconds=queued)

        async for part in self._answered("Forward", context, body):
            yield part

    async def Backward(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        async def body(held: Held) -> pb.StageBackwardResponse:
            h, tensors, _ = await self._receive(request_iterator, held)
            (grad_outputs,) = self._messages.need(tensors, "grad_outputs")
            inputs = tensors.get("inputs")  # absent: use the activations cached by Forward
            given = None if inputs is None else Crossing(inputs, tensors.get("tokens"))
            reply = self._messages.reply_codec(h.reply_codec)
            await self._commits.before(h.microbatch.step)
            done = await self._answering.backward_here(
                self.compute.backward,
                h,
                reply,
                given,
                grad_outputs,
                accumulate=h.accumulate,
                digest_seed=0 if h.accumulate else h.digest_seed,
                holder=_caller(context),
            )
            return pb.StageBackwardResponse(**done.answer())

        async for part in self._answered("Backward", context, body):
            yield part

    async def ForwardBackward(
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        async def body(held: Held) -> pb.StageForwardBackwardResponse:
            h, tensors, _ = await self._receive(request_iterator, held)
            inputs, targets = self._messages.need(tensors, "inputs", "targets")
            rt, reply = self.runtime, self._messages.reply_codec(h.reply_codec)
            given = Crossing(inputs, tensors.get("tokens"))  # a subspace boundary's ids beside
            maybe_die(Point.FORWARD, h.microbatch.step)
            await self._commits.before(h.microbatch.step)
            if h.evaluate:
                loss, queued = await self.worker.run_queued(
                    rt.evaluate, h.microbatch.step, given, targets
                )
                return pb.StageForwardBackwardResponse(loss_sum=loss, queued_seconds=queued)
            done = await self._answering.backward_here(
                self.compute.forward_backward,
                h,
                reply,
                given,
                targets,
                accumulate=h.accumulate,
                digest_seed=0 if h.accumulate else h.digest_seed,
            )
            return pb.StageForwardBackwardResponse(loss_sum=done.loss, **done.answer())

        async for part in self._answered("ForwardBackward", context, body):
            yield part

    async def Push(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        async def body(held: Held) -> pb.StagePushResponse:
            h, tensors, came = await self._receive(request_iterator, held, self._push.room, True)
            inputs, targets = self._messages.need(tensors, "inputs", "targets")
            call = PushCall.received(h, Crossing(inputs, tensors.get("tokens")), targets)
            await self._commits.before(call.step)  # the step before's APPLY, if on its way
            return await self._push.push(h, call, context.time_remaining, came)

        async for part in self._answered("Push", context, body):
            yield part

    async def Record(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        """A push record (`stage_server.replica.push_records`), its tensors if asked."""

        async def body(held: Held) -> pb.StageRecordResponse:
            h, _, _ = await self._receive(request_iterator, held)
            return await self._push.records.answered(h)

        async for part in self._answered("Record", context, body):
            yield part

    # -- commit ---------------------------------------------------------------------------------
    async def _scheduler_only(
        self,
        method: str,
        request: Any,
        context: grpc.aio.ServicerContext,
        unread: AsyncIterable[Any] | None = None,
    ) -> None:
        """Refuse (UNAUTHENTICATED, PERMISSION_DENIED) a commit-protocol call that the scheduler
        did not sign for this replica (`swarm.net.commit_auth`), before anything is used or
        done. A streamed call's `unread` requests are read and dropped first, so that its
        client is told the refusal, not INTERNAL (`swarm.net.refused_streams`)."""
        if self.commit_auth is None:
            return
        try:
            self.commit_auth.check(method, request, context.invocation_metadata())
        except CommitRefused as e:
            self._refusals.warning((method, e.code), "%s: refused %s: %s", self.peer, method, e)
            self.metrics.observe(method, e.code.name, 0.0)
            if unread is not None:
                await self._refused_streams.drain(unread)
            await refuse(context, e.code, str(e))  # told ahead too (`swarm.net.told_ahead`)

    async def Commit(
        self, request: pb.StageCommitRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        await self._scheduler_only("Commit", request, context)

        async def body() -> pb.StageCommitResponse:
            self._route(request.job, request.stage)
            done = await self._commits.commit(Commit.of(request))
            return pb.StageCommitResponse(
                step=done.step,
                already_committed=done.already,
                grad_sq_norm=done.grad_sq_norm,
                sum_checks=done.sum_checks,
                audit_checks=done.audit_checks,
            )

        return await self._serving.run("Commit", context, body)

    async def Discard(
        self, request: pb.StageDiscardRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        await self._scheduler_only("Discard", request, context)

        async def body() -> pb.StageDiscardResponse:
            self._route(request.job, request.stage)
            dropped = await self._commits.discard(request.step)
            return pb.StageDiscardResponse(dropped=dropped)

        return await self._serving.run("Discard", context, body)

    # -- state transfer -------------------------------------------------------------------------
    async def Join(self, request: pb.StageJoinRequest, context: grpc.aio.ServicerContext) -> Any:
        await self._scheduler_only("Join", request, context)

        async def body() -> pb.StageJoinResponse:
            self._route(request.job, request.stage)
            at = await self._transfer.join(
                self.job_id, request.source, request.step, request.ticket, request.epoch
            )
            return pb.StageJoinResponse(step=at, copying=True)

        return await self._serving.run("Join", context, body)

    async def Updates(
        self, request: pb.StageUpdatesRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        async def body() -> AsyncIterator[pb.StageUpdatesResponse]:
            self._route(request.job, request.stage)
            chunk = self.limits.chunk_bytes
            async for part in self._transfer.updates(
                request.job, request.follower, request.ticket, request.from_step, chunk
            ):
                yield part

        async for part in self._serving.stream("Updates", context, body()):
            yield part

    async def LoadState(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        signed_digest = None  # the state's digest the scheduler signed: the state loaded is it
        if self._runtime is not None:  # else unsigned: `load` refuses it (NOT_FOUND)
            signed = pb.StageLoadStateRequest(job=self.job_id, stage=self._runtime.stage)
            # as the scheduler signs
            await self._scheduler_only("LoadState", signed, context, request_iterator)
            if self.commit_auth is not None:
                metadata = context.invocation_metadata() or ()
                signed_digest = next((v for k, v in metadata if k == STATE_DIGEST_KEY), b"")

        async def body() -> pb.StageLoadStateResponse:
            try:
                step = await self._transfer.load(
                    request_iterator, self._route, self.limits, signed_digest
                )
            except SwarmError as refused:
                # Refused mid-stream (a tensor not the stage's, past a bound, another job's):
                # its client still writes the rest, so it is read first, as a refusal from the
                # header is (a stream read to its end already ends this at once).
                await self._refused_streams.after(refused, request_iterator)
                raise
            return pb.StageLoadStateResponse(step=step)

        return await self._serving.run("LoadState", context, body)

    async def DownloadState(
        self, request: pb.StageDownloadStateRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        async def body() -> AsyncIterator[pb.StageDownloadStateResponse]:
            self._route(request.job, request.stage)
            chunk, optim = self.limits.chunk_bytes, request.include_optimizer
            async for part in self._transfer.download(
                request.job, request.follower, request.ticket, optim, chunk
            ):
                yield part

        async for part in self._serving.stream("DownloadState", context, body()):
            yield part

    async def Info(self, request: pb.StageInfoRequest, context: grpc.aio.ServicerContext) -> Any:
        return info_reply(self.peer, self.job_id, self._runtime)


def _caller(context: grpc.aio.ServicerContext) -> str:
    """Whose data-plane call this is, for the activations its Forward keeps
    (`stage_server.replica.activation_cache`): its connection (`peer()`, the caller's address
    and port). A trainer's Forward and Backward of a microbatch ride its one channel to this
    replica; another token holder's Forward of the same microbatch comes on a connection of its
    own. A channel that reconnects between the two costs its Backward a recompute (it is asked
    for the inputs again), never a wrong gradient."""
    return str(context.peer() or "")
