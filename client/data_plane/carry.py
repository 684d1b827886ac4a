"""The carry plane (`runtime.data_plane = "relay"`, a job file's name for it): the trainer
carries every hop itself. Not the NAT relay (`swarm relay`, `swarm.relay`), which carries calls to
peers behind NAT. A task `(step, index, stages)` goes forward through stages 0..S-2,
forward-and-backward at S-1, then backward down to the lowest stage it must accumulate at;
Backward goes to the replica that did the Forward at that stage (its activations are cached
there). Each accumulating hop reports its stage only where it surely accumulated there (see
`swarm.rpc.hop`). A replay whose boundary tensors are still cached costs one call per stage to
replay."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from client.data_plane.boundary_cache import Answer, BoundaryCache
from client.data_plane.hops import StageHops
from client.metrics import TrainerMetrics
from swarm.errors import ActivationsNotCached
from swarm.job.config import JobConfig
from swarm.job.rule import rule_of
from swarm.model.boundary import boundary_of
from swarm.model.data import DataSource
from swarm.proto import tensor_pb2
from swarm.rpc.lease import MicrobatchResult, Replica, Task
from swarm.rpc.stage_client import BackwardResult, StageClient, TensorLike
from swarm.wire import codec

__all__ = ["CarryPlane"]


class CarryPlane:
    def __init__(
        self,
        job: JobConfig,
        hops: StageHops,
        metrics: TrainerMetrics,
        cache: BoundaryCache,
    ) -> None:
        # What each stage was sent and answered is kept in `cache`: the audits read it there
        # after the microbatch (`client.audit.audited.Audited` wraps this plane).
        self.job, self.hops, self.metrics, self.cache = job, hops, metrics, cache

    def follow(self, replicas: Sequence[Sequence[Replica]]) -> None:
        pass  # every hop reads the routes as they are when it is made

    async def train(self, task: Task, data: DataSource) -> MicrobatchResult:
        # pool.mode = "local": replicas differ, so a replay runs the pipeline again, and the
        # result names every replica the run went through (the route record)
        local = rule_of(self.job).rounds
        if len(task.stages) < self.job.training.stages and not local:  # a replay
            replayed = await self._replay_from_cache(task)
            if replayed is not None:
                return replayed
        step, index, stages = task.step, task.index, task.stages
        last, lowest = self.job.training.stages - 1, min(task.stages)
        ids, labels = data.microbatch(step, index)
        # Encoded once; every later hop passes on the messages the stages sent back.
        boundary: list[TensorLike] = [codec.encode(ids, "inputs")]
        targets, tokens = codec.encode(labels, "targets"), self._tokens(ids)
        forward_peer: dict[int, str] = {}
        for k in range(last):
            peer, out = await self.hops.any(
                k,
                lambda c, k=k: c.forward(  # type: ignore[misc]
                    step, index, boundary[k], tokens=tokens if k else None
                ),
            )
            forward_peer[k] = peer
            boundary.append(out)
        holders: dict[int, str] = {}
        done = await self.hops.hopped(
            last,
            lambda c, a: c.forward_backward(
                step,
                index,
                boundary[last],
                targets,
                accumulate=a,
                need_grad_inputs=lowest < last,
                tokens=tokens,
            ),
            accumulate=last in stages,
            need_result=lowest < last,
        )
        forward_peer[last] = done.peer or ""  # "": unknown (the route record needs none then)
        back: dict[int, str] = {}
        result = done.result
        if done.accumulated and done.peer is not None:
            holders[last] = done.peer
        after = done.peer  # who answered the gradient the stage below is given
        before = [forward_peer[last - 1]] if last else []
        self.cache.remember(step, index, last, boundary[last], targets, before, tokens=tokens)
        if result is not None:  # its outputs are the loss; it answered both ways itself
            peer = forward_peer[last]
            answer = Answer(peer, peer, result.grad_inputs, loss_sum=result.loss_sum)
            self.cache.answered(step, index, last, answer)
        # The loss is the same whichever replica computed it, accumulating or not.
        loss = result.loss_sum if last in stages and result is not None else None
        grad = result.grad_inputs if result is not None else None
        for k in range(last - 1, lowest - 1, -1):
            assert grad is not None
            g = grad
            forward_client = self.hops.routes.clients.get(forward_peer[k])  # None: departed
            before = [forward_peer[k - 1]] if k else []
            self.cache.remember(step, index, k, boundary[k], g, [*before, *filter(None, [after])])
            done = await self.hops.hopped(
                k,
                lambda c, a, k=k, g=g, f=forward_client: _backward(  # type: ignore[misc]
                    c, task, k, boundary[k], g, f, a, tokens if k else None
                ),
                prefer=forward_peer[k],
                accumulate=k in stages,
                need_result=k > lowest,
            )
            if done.accumulated and done.peer is not None:
                holders[k] = done.peer
            if done.peer is not None and done.peer != forward_peer[k]:
                back[k] = done.peer
            after = done.peer
            result = done.result
            grad = result.grad_inputs if result is not None else None
            if result is not None and done.peer is not None:
                self.cache.answered(step, index, k, Answer(forward_peer[k], done.peer, grad))
        samples = int(ids.shape[0])
        if not local:
            touched = tuple(sorted(filter(None, {*forward_peer.values(), *back.values()})))
            return MicrobatchResult(step, index, holders, loss, samples, touched=touched)
        chain = tuple(forward_peer[k] for k in range(last + 1))
        return MicrobatchResult(
            step, index, holders, loss, samples, chain, tuple(sorted(back.items()))
        )

    async def evaluate(
        self, task: Task, ids: torch.Tensor, labels: torch.Tensor
    ) -> MicrobatchResult:
        step, index = task.step, task.index
        inputs, targets = codec.encode(ids, "inputs"), codec.encode(labels, "targets")
        last, tokens = self.job.training.stages - 1, self._tokens(ids)
        x: TensorLike = inputs
        for k in range(last):
            _, x = await self.hops.any(
                k, functools.partial(_forward_only, step, index, x, tokens if k else None)
            )
        _, loss = await self.hops.any(last, lambda c: c.evaluate(step, index, x, targets, tokens))
        return MicrobatchResult(step, index, {}, loss, int(ids.shape[0]))

    def _tokens(self, ids: torch.Tensor) -> tensor_pb2.Tensor | None:
        """The token ids every stage after the first needs under a subspace boundary
        (`Boundary.tokens`), encoded once; None (not sent) for a full boundary."""
        tokens = boundary_of(self.job.model).tokens(ids)
        return None if tokens is None else codec.encode(tokens, "tokens")

    async def _replay_from_cache(self, task: Task) -> MicrobatchResult | None:
        """A replay whose stages' boundary tensors are still cached: one call per stage, on any
        replica. A stage whose call may have accumulated without saying so is left out."""
        cached = self.cache.get(task.step, task.index)
        if cached is None or not task.stages <= cached.keys():
            return None
        producers = self.cache.producers(task.step, task.index, task.stages)
        if not producers <= self.hops.routes.clients.keys():
            return None  # one is no member now (gone, or banned): its bytes are not trusted
        last, holders = self.job.training.stages - 1, {}
        tokens = self.cache.tokens(task.step, task.index)
        for k in sorted(task.stages):
            inputs, grad = cached[k]
            t = tokens if k else None
            if k == last:
                peer, _ = await self.hops.accumulating(
                    k,
                    lambda c, a, i=inputs, g=grad, t=t: c.forward_backward(  # type: ignore[misc]
                        task.step, task.index, i, g, accumulate=a, need_grad_inputs=False, tokens=t
                    ),
                    accumulate=True,
                    need_result=False,
                )
            else:
                peer, _ = await self.hops.accumulating(
                    k,
                    lambda c, a, i=inputs, g=grad, t=t: c.backward(  # type: ignore[misc]
                        task.step, task.index, i, g, accumulate=a, need_grad_inputs=False, tokens=t
                    ),
                    accumulate=True,
                    need_result=False,
                )
            if peer is not None:
                holders[k] = peer
        self.metrics.cached_replays.inc()
        touched = producers | set(holders.values())
        return MicrobatchResult(
            task.step,
            task.index,
            holders,
            None,
            self.job.training.microbatch_size,
            touched=tuple(sorted(touched)),
        )


async def _backward(
    client: StageClient,
    task: Task,
    stage: int,
    inputs: TensorLike,
    grad: TensorLike,
    cached_on: StageClient | None,
    accumulate: bool,
    tokens: TensorLike | None,
) -> BackwardResult:
    """Backward at `stage`; without re-sending the inputs when `client` did the forward (its
    activations are cached), with them (and `tokens`) if it no longer has them."""
    need = stage > min(task.stages)
    if client is cached_on:
        try:
            return await client.backward(
                task.step, task.index, None, grad, accumulate=accumulate, need_grad_inputs=need
            )
        except ActivationsNotCached:
            pass  # evicted there: resend with the inputs, and the replica recomputes
    return await client.backward(
        task.step,
        task.index,
        inputs,
        grad,
        accumulate=accumulate,
        need_grad_inputs=need,
        tokens=tokens,
    )


async def _forward_only(
    step: int, index: int, inputs: TensorLike, tokens: TensorLike | None, client: StageClient
) -> tensor_pb2.Tensor:
    return await client.forward(step, index, inputs, evaluate=True, tokens=tokens)
