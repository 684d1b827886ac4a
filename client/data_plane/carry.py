"""The carry plane (`runtime.data_plane = "relay"`, a job file's name for it): the trainer
carries every hop itself. Not the NAT relay (`swarm relay`, `swarm.relay`), which carries calls to
peers behind NAT. A task `(step, index, stages)` goes forward through stages 0..S-2,
forward-and-backward at S-1, then backward down to the lowest stage it must accumulate at;
Backward goes to the replica that did the Forward at that stage (its activations are cached
there). Each accumulating hop reports its stage only where it surely accumulated there (see
`swarm.rpc.hop`). A replay whose boundary tensors are still cached costs one call per stage to
replay.

What crosses into each stage is one `Crossing` (`swarm.wire.crossing`): stage 0's the token ids
themselves, each later stage's the outputs the stage before sent back, beside the token ids
where the job's boundary needs them (`swarm.model.boundary`). Each is made once, then sent, kept
in the boundary cache and replayed whole."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

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
from swarm.rpc.hop import Hopped
from swarm.rpc.lease import MicrobatchResult, Replica, Task
from swarm.rpc.stage_client import BackwardResult, StageClient, TensorLike, WireCrossing
from swarm.wire import codec
from swarm.wire.crossing import Crossing

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
        self.last = job.training.stages - 1

    def follow(self, replicas: Sequence[Sequence[Replica]]) -> None:
        pass  # every hop reads the routes as they are when it is made

    async def stop(self) -> None:
        pass  # nothing runs past a microbatch's report: its audits end before it

    async def train(self, task: Task, data: DataSource) -> MicrobatchResult:
        # pool.mode = "local": replicas differ, so a replay runs the pipeline again, and the
        # result names every replica the run went through (the route record)
        local = rule_of(self.job).rounds
        if len(task.stages) < self.job.training.stages and not local:  # a replay
            replayed = await self._replay_from_cache(task)
            if replayed is not None:
                return replayed
        ids, labels = data.microbatch(task.step, task.index)
        given, peers = await self._forward(task, ids)
        run = _Run(task, given, dict(enumerate(peers)))
        done = await self._forward_backward(run, codec.encode(labels, "targets"))
        await self._backward(run, done)
        # The loss is the same whichever replica computed it, accumulating or not.
        last = done.result
        loss = last.loss_sum if last is not None and self.last in task.stages else None
        return run.result(loss, int(ids.shape[0]), local)

    async def evaluate(
        self, task: Task, ids: torch.Tensor, labels: torch.Tensor
    ) -> MicrobatchResult:
        step, index, targets = task.step, task.index, codec.encode(labels, "targets")
        given, _ = await self._forward(task, ids, evaluate=True)
        _, loss = await self.hops.any(
            self.last, lambda c: c.evaluate(step, index, given[-1], targets)
        )
        return MicrobatchResult(step, index, {}, loss, int(ids.shape[0]))

    async def _forward(
        self, task: Task, ids: torch.Tensor, *, evaluate: bool = False
    ) -> tuple[list[WireCrossing], list[str]]:
        """Stages 0..S-2 forward, each on any replica: what crossed into every stage (the
        last's too), and who answered each forward. `evaluate`: a validation microbatch's."""
        # Encoded once; every later hop passes on the messages the stages sent back.
        given: list[WireCrossing] = [Crossing(codec.encode(ids, "inputs"))]
        tokens, peers = self._tokens(ids), []
        for k in range(self.last):
            forward = functools.partial(
                _forward_at, task.step, task.index, given[k], evaluate=evaluate
            )
            peer, out = await self.hops.any(k, forward)
            peers.append(peer)
            given.append(Crossing(out, tokens))
        return given, peers

    async def _forward_backward(self, run: _Run, targets: TensorLike) -> Hopped[BackwardResult]:
        """The last stage, forward and backward on one replica (its outputs are the loss: it
        answers both ways itself), kept in the cache with what it answered."""
        task, last, lowest = run.task, self.last, min(run.task.stages)
        done = await self.hops.hopped(
            last,
            lambda c, a: c.forward_backward(
                task.step,
                task.index,
                run.given[last],
                targets,
                accumulate=a,
                need_grad_inputs=lowest < last,
            ),
            accumulate=last in task.stages,
            need_result=lowest < last,
        )
        peer = done.peer or ""  # "": unknown (the route record needs none then)
        run.forward_peer[last] = peer
        run.held(last, done)
        self.cache.remember(task.step, task.index, last, run.given[last], targets, run.before(last))
        if done.result is not None:
            answer = Answer(peer, peer, done.result.grad_inputs, loss_sum=done.result.loss_sum)
            self.cache.answered(task.step, task.index, last, answer)
        return done

    async def _backward(self, run: _Run, done: Hopped[BackwardResult]) -> None:
        """Backward from the stage below the last down to the lowest the task accumulates at,
        each given the input gradient the stage above answered (`done`), preferably on the
        replica that did its forward; what each was sent and answered kept in the cache."""
        task = run.task
        step, index = task.step, task.index
        for k in range(self.last - 1, min(task.stages) - 1, -1):
            grad = done.result.grad_inputs if done.result is not None else None
            assert grad is not None
            after = done.peer  # who answered the gradient this stage is given
            producers = [*run.before(k), *filter(None, [after])]
            self.cache.remember(step, index, k, run.given[k], grad, producers)
            forward_peer = run.forward_peer[k]
            cached_on = self.hops.routes.clients.get(forward_peer)  # None: departed
            done = await self.hops.hopped(
                k,
                functools.partial(_backward_at, task, k, run.given[k], grad, cached_on),
                prefer=forward_peer,
                accumulate=k in task.stages,
                need_result=k > min(task.stages),
            )
            run.held(k, done)
            if done.peer is not None and done.peer != forward_peer:
                run.back[k] = done.peer
            if done.result is not None and done.peer is not None:
                answer = Answer(forward_peer, done.peer, done.result.grad_inputs)
                self.cache.answered(step, index, k, answer)

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
        if not producers <= self.hops.routes.clients.members():
            return None  # one is no member now (gone, or banned): its bytes are not trusted
        holders = {}
        for k in sorted(task.stages):
            given, grad = cached[k]
            peer, _ = await self.hops.accumulating(
                k,
                functools.partial(_replayed, task, k == self.last, given, grad),
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


@dataclass
class _Run:
    """One run of a microbatch through the pipeline: what crossed into each stage, and who
    answered it each way and accumulated it."""

    task: Task
    given: list[WireCrossing]  # stage -> what crossed into it
    forward_peer: dict[int, str]  # stage -> who answered its outputs
    back: dict[int, str] = field(default_factory=dict)  # who answered a backward elsewhere
    holders: dict[int, str] = field(default_factory=dict)  # stage -> who accumulated it

    def before(self, stage: int) -> list[str]:
        """Who answered the outputs that crossed into `stage` (none: it is stage 0)."""
        return [self.forward_peer[stage - 1]] if stage else []

    def held(self, stage: int, done: Hopped[BackwardResult]) -> None:
        """`done`, the hop of `stage` that accumulates, surely accumulated where it says."""
        if done.accumulated and done.peer is not None:
            self.holders[stage] = done.peer

    def result(self, loss: float | None, samples: int, local: bool) -> MicrobatchResult:
        """The run's result; `local` (replicas differ): with every replica it went through."""
        step, index = self.task.step, self.task.index
        if not local:
            peers = {*self.forward_peer.values(), *self.back.values()}
            touched = tuple(sorted(filter(None, peers)))
            return MicrobatchResult(step, index, self.holders, loss, samples, touched=touched)
        chain = tuple(self.forward_peer[k] for k in sorted(self.forward_peer))
        back = tuple(sorted(self.back.items()))
        return MicrobatchResult(step, index, self.holders, loss, samples, chain, back)


async def _forward_at(
    step: int, index: int, given: WireCrossing, client: StageClient, *, evaluate: bool
) -> tensor_pb2.Tensor:
    return await client.forward(step, index, given, evaluate=evaluate)


async def _backward_at(
    task: Task,
    stage: int,
    given: WireCrossing,
    grad: TensorLike,
    cached_on: StageClient | None,
    client: StageClient,
    accumulate: bool,
) -> BackwardResult:
    """Backward at `stage`; without re-sending what crossed into it when `client` did the
    forward (its activations are cached), with it (`given`) if it no longer has them."""
    need = stage > min(task.stages)
    if client is cached_on:
        try:
            return await client.backward(
                task.step, task.index, None, grad, accumulate=accumulate, need_grad_inputs=need
            )
        except ActivationsNotCached:
            pass  # evicted there: resend with the inputs, and the replica recomputes
    return await client.backward(
        task.step, task.index, given, grad, accumulate=accumulate, need_grad_inputs=need
    )


async def _replayed(
    task: Task,
    last: bool,
    given: WireCrossing,
    grad: TensorLike,
    client: StageClient,
    accumulate: bool,
) -> BackwardResult:
    """A stage of a replay from the cache, from the bytes it was sent (`given`; `grad`, the
    targets at the `last` stage): on any replica, which recomputes it, no gradient back."""
    again = client.forward_backward if last else client.backward
    return await again(
        task.step, task.index, given, grad, accumulate=accumulate, need_grad_inputs=False
    )
