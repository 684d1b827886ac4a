"""`StageService` over a `StageRuntime`: decode, check the route, run the compute on the replica's
worker thread, encode. Errors become status codes in `swarm.rpc.servicing`, as in every servicer; a
bad request never takes the server down."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import torch
from google.protobuf.message import Message

from stage_server.averaging import butterfly as averaging
from stage_server.averaging import owner as averager
from stage_server.averaging.error_feedback import ErrorFeedback
from stage_server.copying import Copy
from stage_server.pushing import Downstream
from stage_server.runtime import Receipt, StageRuntime
from swarm.errors import (
    Busy,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    WireError,
)
from swarm.ops.faults import Point, maybe_die
from swarm.ops.metrics import StageMetrics
from swarm.proto import stage_pb2 as pb
from swarm.proto import stage_pb2_grpc, tensor_pb2
from swarm.rpc.servicing import Servicing
from swarm.rpc.stage_client import StageClient
from swarm.wire import chunking as wire
from swarm.wire import codec
from swarm.wire.chunking import grpc_options

__all__ = ["StageServicer"]

log = logging.getLogger(__name__)
T = TypeVar("T")
M = TypeVar("M", bound=Message)
_LOAD_EMA = 0.2  # weight of the newest call in the reported moving average


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
    ) -> None:
        self.peer, self.metrics, self._executor = peer, metrics, executor
        self.throttle = throttle  # >1 stands in for a slower device: compute takes that much longer
        self.job_id = ""
        self._runtime: StageRuntime | None = None
        self._chunk, self._max_bytes, self._block = 4 << 20, 1 << 30, 2048
        self.token = token
        self.waiting = 0  # compute calls queued or running: the load this peer reports
        self.ema_seconds: float | None = None  # moving average of one compute call (seconds)
        self.averager = averager.Averager()
        self.channels = averaging.ChannelPool(token=token, options=grpc_options(64 << 20))
        self._serving = Servicing(peer, metrics.observe)
        self._copy: Copy | None = None  # a joining replica's background copy of a member
        self._downstream: Downstream | None = None  # the push plane's next stage, as seen here
        self._feedback = ErrorFeedback()  # what lossy averaging dropped, for the next round

    def serve(self, runtime: StageRuntime, job_id: str) -> None:
        """Start serving `runtime` as job `job_id` (called on the event loop between calls)."""
        self._runtime, self.job_id = runtime, job_id
        self._feedback = ErrorFeedback()  # a state installed anew starts from no residuals
        rt = runtime.job.runtime
        self._chunk, self._max_bytes = rt.chunk_bytes, rt.max_tensor_bytes
        self._block = runtime.job.compression.block_size
        self.metrics.bind(job_id, runtime.stage)
        self._close_downstream()
        self._downstream = Downstream(runtime.job, job_id, runtime.stage, self.token)

    def release(self) -> None:
        """Stop serving: later calls are NOT_FOUND until the next `serve`."""
        self._runtime, self.job_id = None, ""
        self._stop_copy()
        self._close_downstream()

    def _close_downstream(self) -> None:
        downstream, self._downstream = self._downstream, None
        if downstream is not None:  # its calls in flight end with their own deadlines
            asyncio.get_running_loop().create_task(downstream.close())

    def _stop_copy(self) -> None:
        if self._copy is not None:
            self._copy.task.cancel()
            self._copy = None

    @property
    def runtime(self) -> StageRuntime:
        if self._runtime is None:
            raise NotFound(f"peer {self.peer} serves no stage yet")
        return self._runtime

    # -- plumbing -------------------------------------------------------------------------------
    async def _compute(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run on the replica's single worker thread: torch work is serial per replica, and the
        event loop stays free to move bytes for the calls queued behind it."""
        result, _ = await self._compute_queued(fn, *args, **kwargs)
        return result

    async def _compute_queued(
        self, fn: Callable[..., T], *args: Any, **kwargs: Any
    ) -> tuple[T, float]:
        """`_compute`, also returning how long the call waited for the worker: trainers subtract
        it, so their throughput estimate of this replica is its service time, not its queue."""
        self.metrics.queue(1)
        self.waiting += 1
        submitted = time.perf_counter()
        started: list[float] = []

        def timed() -> T:
            started.append(time.perf_counter())
            return self._throttled(functools.partial(fn, *args, **kwargs))

        try:
            loop = asyncio.get_running_loop()
            result = await loop.run_in_executor(self._executor, timed)
            return result, started[0] - submitted
        finally:
            self.metrics.queue(-1)
            self.waiting -= 1

    def _throttled(self, call: Callable[[], T]) -> T:
        start = time.perf_counter()
        try:
            return call()
        finally:
            if self.throttle > 1:  # hold the worker, as a slower device would be held
                time.sleep((self.throttle - 1) * (time.perf_counter() - start))
            seconds = time.perf_counter() - start
            self.ema_seconds = (
                seconds
                if self.ema_seconds is None
                else (_LOAD_EMA * seconds + (1 - _LOAD_EMA) * self.ema_seconds)
            )

    def _route(self, job: str, stage: int) -> None:
        if self._runtime is None or job != self.job_id:
            raise NotFound(f"unknown job {job!r}; this server serves job {self.job_id!r}")
        if stage != self.runtime.stage:
            raise NotFound(
                f"stage {stage} is not served here; this server serves stage {self.runtime.stage}"
            )

    async def _receive(self, requests: AsyncIterator[Any]) -> tuple[Any, dict[str, torch.Tensor]]:
        # One microbatch's tensors at most: a header declaring more (a batch far above
        # microbatch_size) is refused before its bytes are allocated.
        limit = min(self._max_bytes, self.runtime.max_request_bytes())
        received = await wire.receive(requests, max_bytes=limit)
        self._route(received.header.job, received.header.stage)
        tensors = wire.decode_named(received, device="cpu", max_bytes=limit)
        self.metrics.received(
            sum(t.nbytes for t in received.header.tensors),
            sum(t.numel() * t.element_size() for t in tensors.values()),
        )
        return received.header, tensors

    @staticmethod
    def _need(tensors: dict[str, torch.Tensor], *names: str) -> list[torch.Tensor]:
        missing = [n for n in names if n not in tensors]
        if missing:
            raise InvalidArgument(f"missing tensors {missing}; got {sorted(tensors)}")
        return [tensors[n] for n in names]

    def _reply_codec(self, value: int) -> int:
        if value not in codec.CODECS.values():
            raise InvalidArgument(f"unknown reply codec {value}")
        return value

    def _encode(
        self, tensor: torch.Tensor | None, name: str, reply_codec: int
    ) -> list[tensor_pb2.Tensor]:
        if tensor is None:
            return []
        msg = codec.encode(tensor, name, reply_codec, self._block)
        self.metrics.sent(msg.nbytes, tensor.numel() * tensor.element_size())
        return [msg]

    def _split(self, msg: M) -> Iterator[M]:
        return wire.split(msg, self._chunk)

    def _receipt(self, r: Receipt) -> pb.Receipt:
        self.metrics.accumulated(0 if r.duplicate else r.samples, len(self.runtime.receipts()))
        return pb.Receipt(
            peer=self.peer,
            stage=r.stage,
            samples=r.samples,
            duplicate=r.duplicate,
            microbatch=pb.MicrobatchId(step=r.step, index=r.index),
        )

    # -- the service ----------------------------------------------------------------------------
    async def Forward(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        async def body() -> pb.StageForwardResponse:
            h, tensors = await self._receive(request_iterator)
            (inputs,) = self._need(tensors, "inputs")
            reply = self._reply_codec(h.reply_codec)
            maybe_die(Point.FORWARD, h.microbatch.step)
            out, queued = await self._compute_queued(
                self.runtime.forward,
                h.microbatch.step,
                h.microbatch.index,
                inputs,
                evaluate=h.evaluate,
            )
            return pb.StageForwardResponse(
                tensors=self._encode(out, "outputs", reply), queued_seconds=queued
            )

        for msg in self._split(await self._serving.run("Forward", context, body)):
            yield msg

    async def Backward(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        async def body() -> pb.StageBackwardResponse:
            h, tensors = await self._receive(request_iterator)
            (grad_outputs,) = self._need(tensors, "grad_outputs")
            inputs = tensors.get("inputs")  # absent: use the activations cached by Forward
            reply = self._reply_codec(h.reply_codec)
            (grad, receipt), queued = await self._compute_queued(
                self.runtime.backward,
                h.microbatch.step,
                h.microbatch.index,
                inputs,
                grad_outputs,
                accumulate=h.accumulate,
                need_grad_inputs=h.need_grad_inputs,
            )
            maybe_die(Point.BACKWARD, h.microbatch.step)  # accumulated, not yet answered
            return pb.StageBackwardResponse(
                tensors=self._encode(grad, "grad_inputs", reply),
                receipt=self._receipt(receipt),
                queued_seconds=queued,
            )

        for msg in self._split(await self._serving.run("Backward", context, body)):
            yield msg

    async def ForwardBackward(
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        async def body() -> pb.StageForwardBackwardResponse:
            h, tensors = await self._receive(request_iterator)
            inputs, targets = self._need(tensors, "inputs", "targets")
            reply = self._reply_codec(h.reply_codec)
            maybe_die(Point.FORWARD, h.microbatch.step)
            if h.evaluate:
                loss, queued = await self._compute_queued(
                    self.runtime.evaluate, h.microbatch.step, inputs, targets
                )
                return pb.StageForwardBackwardResponse(loss_sum=loss, queued_seconds=queued)
            (loss, grad, receipt), queued = await self._compute_queued(
                self.runtime.forward_backward,
                h.microbatch.step,
                h.microbatch.index,
                inputs,
                targets,
                accumulate=h.accumulate,
                need_grad_inputs=h.need_grad_inputs,
            )
            maybe_die(Point.BACKWARD, h.microbatch.step)
            return pb.StageForwardBackwardResponse(
                tensors=self._encode(grad, "grad_inputs", reply),
                loss_sum=loss,
                receipt=self._receipt(receipt),
                queued_seconds=queued,
            )

        for msg in self._split(await self._serving.run("ForwardBackward", context, body)):
            yield msg

    async def Push(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        async def body() -> pb.StagePushResponse:
            h, tensors = await self._receive(request_iterator)
            inputs, targets = self._need(tensors, "inputs", "targets")
            rt, downstream = self.runtime, self._downstream
            if self.waiting >= rt.job.runtime.max_queue:
                raise Busy(f"{self.peer}: {self.waiting} microbatches queued; try another replica")
            step, index = h.microbatch.step, h.microbatch.index
            here, backward = rt.stage in h.accumulate, rt.job.compression.backward
            reply = codec.codec_from_name(backward)
            maybe_die(Point.FORWARD, step)
            if h.evaluate:
                return await self._push_evaluation(h, inputs, targets, context)
            if rt.is_last:
                (loss, grad, receipt), queued = await self._compute_queued(
                    rt.forward_backward,
                    step,
                    index,
                    inputs,
                    targets,
                    accumulate=here,
                    need_grad_inputs=h.need_grad_inputs,
                )
                maybe_die(Point.BACKWARD, step)
                return pb.StagePushResponse(
                    tensors=self._encode(grad, "grad_inputs", reply),
                    receipts=[self._receipt(receipt)] if here else [],
                    loss_sum=loss,
                    queued_seconds=queued,
                )
            assert downstream is not None
            outputs, queued = await self._compute_queued(rt.forward, step, index, inputs)
            need_grad = here or h.need_grad_inputs  # a backward here needs its outputs' gradient
            left = context.time_remaining()
            pushed = await downstream.push(
                step,
                index,
                outputs,
                targets,
                [k for k in h.accumulate if k > rt.stage],
                list(h.route),
                need_grad=need_grad,
                # Leave this stage's backward and the answer a share of the caller's deadline.
                deadline=time.monotonic() + (left or rt.job.runtime.rpc_timeout_s) * 0.9,
            )
            receipts, grad = pushed.receipts, None
            if need_grad:
                assert pushed.grad is not None
                grad_outputs = pushed.grad
                if not isinstance(grad_outputs, torch.Tensor):
                    grad_outputs = codec.decode(grad_outputs, max_bytes=self._max_bytes)
                grad, receipt = await self._compute(
                    rt.backward,
                    step,
                    index,
                    inputs,
                    grad_outputs,
                    accumulate=here,
                    need_grad_inputs=h.need_grad_inputs,
                )
                maybe_die(Point.BACKWARD, step)
                if here:
                    receipts.append(self._receipt(receipt))
            return pb.StagePushResponse(
                tensors=self._encode(grad, "grad_inputs", reply),
                receipts=receipts,
                uncertain=sorted(pushed.uncertain),
                loss_sum=pushed.loss_sum,
                queued_seconds=queued,
            )

        for msg in self._split(await self._serving.run("Push", context, body)):
            yield msg

    async def _push_evaluation(
        self,
        h: pb.StagePushRequest,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        context: grpc.aio.ServicerContext,
    ) -> pb.StagePushResponse:
        """A validation microbatch on the push plane: forward here, on to the next stage, the
        last stage's loss back; nothing kept, nothing accumulated."""
        rt, step = self.runtime, h.microbatch.step
        if rt.is_last:
            loss, queued = await self._compute_queued(rt.evaluate, step, inputs, targets)
            return pb.StagePushResponse(loss_sum=loss, queued_seconds=queued)
        assert self._downstream is not None
        outputs, queued = await self._compute_queued(
            rt.forward, step, h.microbatch.index, inputs, evaluate=True
        )
        left = context.time_remaining()
        pushed = await self._downstream.push(
            step,
            h.microbatch.index,
            outputs,
            targets,
            [],
            list(h.route),
            need_grad=False,
            deadline=time.monotonic() + (left or rt.job.runtime.rpc_timeout_s) * 0.9,
            evaluate=True,
        )
        return pb.StagePushResponse(loss_sum=pushed.loss_sum, queued_seconds=queued)

    async def Commit(
        self, request: pb.StageCommitRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        async def body() -> pb.StageCommitResponse:
            self._route(request.job, request.stage)
            rt, step, already, sq_norm = self.runtime, request.step, False, 0.0
            if request.phase == pb.COMMIT_PHASE_BOTH and rt.job.training.grad_clip > 0:
                raise FailedPrecondition(
                    "training.grad_clip needs the whole model's gradient norm: the coordinator "
                    "commits such a job in two phases (PREPARE, then APPLY)"
                )
            if request.phase in (pb.COMMIT_PHASE_BOTH, pb.COMMIT_PHASE_PREPARE):
                if step < rt.step:
                    return pb.StageCommitResponse(step=rt.step, already_committed=True)
                try:
                    sums = await self._compute(
                        rt.prepare, step, list(request.microbatches), request.total_samples
                    )
                except WireError as e:  # tell the pool now, not when its round times out
                    self.averager.abort((request.job, request.stage, request.round), str(e))
                    raise
                if len(request.group) > 1:
                    sums = await self._average(request, sums)
                await self._compute(rt.set_prepared, step, sums, request.total_samples)
                sq_norm = await self._compute(rt.prepared_sq_norm, step)
            if request.phase in (pb.COMMIT_PHASE_BOTH, pb.COMMIT_PHASE_APPLY):
                scale = request.grad_scale if request.HasField("grad_scale") else 1.0
                if not 0.0 < scale <= 1.0:
                    raise InvalidArgument(f"grad_scale must be in (0, 1]; got {scale}")
                already = await self._compute(rt.apply, step, scale)
                self._feedback.applied(request.job, request.stage, step)
                if not already:
                    log.info("%s: stage %d committed step %d", self.peer, request.stage, step)
                self.metrics.committed(rt.step, applied=not already)
            return pb.StageCommitResponse(
                step=rt.step, already_committed=already, grad_sq_norm=sq_norm
            )

        return await self._serving.run("Commit", context, body)

    async def _average(
        self, request: pb.StageCommitRequest, sums: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """The pool's summed gradient: butterfly all-reduce with the round's group."""
        rt = self.runtime
        if not 0 <= request.group_index < len(request.group):
            raise InvalidArgument(f"group_index {request.group_index} outside the group")
        start = time.perf_counter()
        maybe_die(Point.AVERAGING, request.step)
        flat = averager.flatten(sums)
        averaged, residuals = codec.codec_from_name(rt.job.compression.averaging), None
        if rt.job.compression.error_feedback and averaged != codec.CODEC_NONE:  # a lossy one only
            residuals = self._feedback.start(request.job, request.stage, request.step, flat)
        total = await averaging.all_reduce(
            flat,
            group=list(request.group),
            index=request.group_index,
            round=request.round,
            job=request.job,
            stage=request.stage,
            averager=self.averager,
            channels=self.channels,
            codec=averaged,
            residuals=residuals,
            block_size=self._block,
            timeout_s=rt.job.runtime.averaging_timeout_s,
            chunk_bytes=self._chunk,
            max_bytes=self._max_bytes,
            on_bytes=self.metrics.averaged,
        )
        self.metrics.averaging_seconds(time.perf_counter() - start)
        if residuals is not None:
            self._feedback.prepared(request.job, request.stage, request.step, residuals)
        return averager.unflatten(total, sums)

    async def Discard(
        self, request: pb.StageDiscardRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        async def body() -> pb.StageDiscardResponse:
            self._route(request.job, request.stage)
            dropped = await self._compute(self.runtime.discard, request.step)
            log.warning("%s: voided %d microbatches of step %d", self.peer, dropped, request.step)
            self.metrics.accumulated(0, 0)
            return pb.StageDiscardResponse(dropped=dropped)

        return await self._serving.run("Discard", context, body)

    async def Join(self, request: pb.StageJoinRequest, context: grpc.aio.ServicerContext) -> Any:
        async def body() -> pb.StageJoinResponse:
            self._route(request.job, request.stage)
            rt, copy = self.runtime, self._copy
            if copy is not None and copy.address == request.source and copy.running:
                if copy.loaded and rt.following and rt.step < request.step:
                    # The update it lacks was just applied at the source: fetch it now.
                    await copy.reach(request.step, rt.job.runtime.rpc_timeout_s / 4)
                if copy.loaded and rt.following and rt.step == request.step:
                    log.info(
                        "%s: joined stage %d at step %d from %s",
                        self.peer,
                        rt.stage,
                        rt.step,
                        request.source,
                    )
                    self.metrics.committed(rt.step, applied=False)
                at = rt.step if copy.loaded and rt.following else -1  # -1: nothing copied yet
                return pb.StageJoinResponse(step=at, copying=True)
            if copy is not None and copy.error is not None and copy.address == request.source:
                log.info("%s: copying %s again after: %s", self.peer, request.source, copy.error)
            # Not copying `source` (a first ask, another source, a copy that failed or ended):
            # start one; the answer is where this replica is now, which the coordinator does
            # not take for a member's step.
            self._stop_copy()
            source = StageClient(request.source, rt.job, self.job_id, rt.stage, self.token)
            self._copy = Copy(source, rt, self._compute, self.peer)
            return pb.StageJoinResponse(step=-1, copying=True)

        return await self._serving.run("Join", context, body)

    async def Updates(
        self, request: pb.StageUpdatesRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        async def body() -> list[pb.StageUpdatesResponse]:
            self._route(request.job, request.stage)
            rt = self.runtime
            # On the worker thread, between updates: the log and the step move together there.
            updates = await self._compute(rt.updates.since, request.follower, request.from_step)
            return [
                pb.StageUpdatesResponse(
                    tensors=[codec.encode(g, str(i))],
                    step=u.step,
                    total_samples=u.total_samples,
                    grad_scale=u.scale,
                )
                for u in updates
                for i, g in enumerate(u.grad_sums)
            ]

        for msg in await self._serving.run("Updates", context, body):
            for part in self._split(msg):
                yield part

    async def LoadState(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        async def body() -> pb.StageLoadStateResponse:
            stream, state, step = request_iterator.__aiter__(), {}, -1
            # The whole state is at most what this stage's can take, and every tensor must be
            # one of the stage's: bytes beyond either are refused, not held until memory runs out.
            rt = self.runtime
            budget = rt.max_state_bytes()
            while True:
                limit = min(self._max_bytes, budget)
                try:
                    received = await wire.receive(stream, max_bytes=limit)
                except wire.EndOfStream:
                    break
                except ResourceExhausted as e:
                    raise ResourceExhausted(
                        f"{e}: stage {rt.stage}'s state takes at most {rt.max_state_bytes()} "
                        f"bytes, of which {rt.max_state_bytes() - budget} were sent already"
                    ) from None
                self._route(received.header.job, received.header.stage)
                step = received.header.step
                tensors = wire.decode_named(received, max_bytes=limit)
                budget -= sum(t.nbytes for t in tensors.values())
                for name, tensor in tensors.items():
                    rt.check_state_tensor(name, tensor)
                    state[name] = tensor.clone()  # the wire buffer is read-only
            if step < 0:
                raise InvalidArgument("LoadState carried no state")
            self._stop_copy()  # a rollback: a copy of the state before it is moot
            await self._compute(self.runtime.load_state, step, state)
            log.warning(
                "%s: loaded stage %d's state of step %d (a rollback)",
                self.peer,
                self.runtime.stage,
                step,
            )
            self.metrics.committed(step, applied=False)
            return pb.StageLoadStateResponse(step=step)

        return await self._serving.run("LoadState", context, body)

    async def Info(self, request: pb.StageInfoRequest, context: grpc.aio.ServicerContext) -> Any:
        rt = self._runtime
        if rt is None:
            return pb.StageInfoResponse(peer=self.peer)
        return pb.StageInfoResponse(
            peer=self.peer,
            job=self.job_id,
            stage=rt.stage,
            num_stages=rt.job.training.stages,
            step=rt.step,
            device=str(rt.device),
            num_parameters=rt.num_parameters(),
            layers=rt.layers,
            pending_microbatches=len(rt.receipts()),
            receipts=sorted(rt.receipts()),
            next_receipts=sorted(rt.receipts(rt.step + 1)),
            applied_step=rt.applied[0],
            applied_scale=rt.applied[1],
        )

    async def DownloadState(
        self, request: pb.StageDownloadStateRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        async def body() -> list[pb.StageDownloadStateResponse]:
            self._route(request.job, request.stage)
            # Snapshot on the worker thread, between updates, so the state is of one step.
            rt = self.runtime

            def snapshot() -> tuple[int, dict[str, torch.Tensor]]:
                if request.follower:  # a joining peer: keep the updates it will lack
                    rt.updates.follow(request.follower, rt.step)
                return rt.step, rt.export_state(request.include_optimizer)

            step, state = await self._compute(snapshot)
            maybe_die(Point.STATE_DOWNLOAD, step)
            return [
                pb.StageDownloadStateResponse(tensors=[codec.encode(v, k)], step=step)
                for k, v in state.items()
            ]

        for msg in await self._serving.run("DownloadState", context, body):
            for part in self._split(msg):
                yield part
