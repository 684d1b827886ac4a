"""The push data plane, the trainer's side: one call to a replica of the first stage carries
the microbatch through every stage and back (`stage_server.replica.next_hop`); this trainer's link
carries its tokens, targets and receipts only. Stages the answer names uncertain, or all of them
when the call failed after it may have accumulated, are left out of the report: the coordinator
adopts their late receipts or replays them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Protocol

import torch

from client.data_plane.hops import StageHops
from client.metrics import TrainerMetrics
from swarm.job.config import JobConfig
from swarm.job.rule import rule_of
from swarm.model.boundary import boundary_of
from swarm.model.data import DataSource
from swarm.proto import stage_pb2 as pb
from swarm.rpc.hop import any_error
from swarm.rpc.lease import (
    ContributionAudit,
    GradientDigest,
    MicrobatchResult,
    Replica,
    Task,
    Verdict,
)
from swarm.rpc.push_call import PushCall, push_deadline_s
from swarm.rpc.stage_client import WirePush, named
from swarm.wire import codec
from swarm.wire.crossing import Crossing

__all__ = ["Found", "PushPlane", "PushTrust", "Unaudited"]

# What a microbatch's audit found: the liars, the re-executions it took, the drawn
# contributions' gradient digests
Found = tuple[tuple[Verdict, ...], int, list[GradientDigest]]


class PushTrust(Protocol):
    """What the push plane asks of the trainer's audits (`client.audit.push_audit.PushAudits`;
    `Unaudited` where the job audits nothing), composed in `client.data_plane.plane`."""

    def run_id(self, drawn: Sequence[ContributionAudit]) -> int:
        """The id of a microbatch's run at every replica of its path; 0: nothing recorded."""
        ...

    def set_aside(self) -> set[str]:
        """Receivers a boundary dispute set aside."""
        ...

    def challenged(self) -> set[str]:
        """Senders a boundary dispute challenges (routed through, to be seen again)."""
        ...

    async def audited(
        self,
        task: Task,
        run: int,
        chain: Sequence[str],
        holders: dict[int, str],
        ids: torch.Tensor,
        labels: torch.Tensor,
        loss: float,
    ) -> Found:
        """Run `run` of `task` pushed through `chain` audited: the liars found, the
        re-executions it took, and the drawn contributions' gradient digests."""
        ...

    def defers(self, task: Task) -> bool:
        """Whether `task`'s audit may end after its microbatch is reported (`later`); audits of
        steps past their bound are cut as `task`'s step is given."""
        ...

    def later(self, done: MicrobatchResult, audit: Callable[[], Awaitable[Found]]) -> None:
        """Run `audit` (`done`'s, as `audited` runs it) after `done` is reported, reporting
        what it found when it ends."""
        ...

    async def settled(self, before: int) -> None:
        """Every audit of a step before `before` ended."""
        ...

    async def stop(self) -> None:
        """The trainer shuts down: every audit still out cancelled, and ended."""
        ...


class Unaudited:
    """The null `PushTrust`: nothing is recorded, set aside or audited."""

    def run_id(self, drawn: Sequence[ContributionAudit]) -> int:
        return 0

    def set_aside(self) -> set[str]:
        return set()

    def challenged(self) -> set[str]:
        return set()

    async def audited(
        self,
        task: Task,
        run: int,
        chain: Sequence[str],
        holders: dict[int, str],
        ids: torch.Tensor,
        labels: torch.Tensor,
        loss: float,
    ) -> Found:
        return (), 0, []

    def defers(self, task: Task) -> bool:
        return False

    def later(self, done: MicrobatchResult, audit: Callable[[], Awaitable[Found]]) -> None:
        pass

    async def settled(self, before: int) -> None:
        pass

    async def stop(self) -> None:
        pass


class PushPlane:
    def __init__(
        self,
        job: JobConfig,
        hops: StageHops,
        metrics: TrainerMetrics,
        trust: PushTrust | None = None,
    ) -> None:
        self.job, self.hops, self.metrics = job, hops, metrics
        self.trust = trust or Unaudited()  # the trainer's audits (`client.audit.push_audit`)
        self._routes: list[pb.Route] = []  # per stage after the first: who serves it
        self.boundary = boundary_of(job.model)

    async def stop(self) -> None:
        await self.trust.stop()  # its late audits

    def follow(self, replicas: Sequence[Sequence[Replica]]) -> None:
        if len(replicas) != self.job.training.stages:
            return  # no view of the stages yet
        self._routes = [
            pb.Route(
                peers=[r.peer for r in members],
                addresses=[r.address for r in members],
                throughput=[r.throughput or 0.0 for r in members],
            )
            for members in replicas[1:]
        ]

    def _route(self) -> list[pb.Route]:
        """The routes, less the receivers a boundary dispute set aside (`Disputes.set_aside`),
        where their stage keeps another member, and through its challenged sender."""
        aside, challenged = self.trust.set_aside(), self.trust.challenged()
        if not aside and not challenged:
            return self._routes
        routes = []
        for r in self._routes:
            # through a challenged sender where it is a member, else as set aside allows
            keep = [i for i, p in enumerate(r.peers) if p in challenged] or [
                i for i, p in enumerate(r.peers) if p not in aside
            ]
            keep = keep or list(range(len(r.peers)))
            routes.append(
                pb.Route(
                    peers=[r.peers[i] for i in keep],
                    addresses=[r.addresses[i] for i in keep],
                    throughput=[r.throughput[i] for i in keep],
                )
            )
        return routes

    def _narrow(self, labels: torch.Tensor) -> torch.Tensor:
        """The targets as every hop carries them (narrow under a subspace boundary, where they
        ride beside a few coefficients per token: `Boundary.targets`)."""
        return self.boundary.targets(labels)

    def _timeout(self) -> float:
        return push_deadline_s(self.job)  # the whole path

    async def train(self, task: Task, data: DataSource) -> MicrobatchResult:
        step, index, stages = task.step, task.index, task.stages
        ids, labels = data.microbatch(step, index)
        labels = self._narrow(labels)  # as sent: what stage 0 commits to (`PushAudits`)
        last, timeout = self.job.training.stages - 1, self._timeout()
        # this run's records at each replica; 0: none kept, nothing to audit (`PushAudits`).
        # A task the scheduler signed is pushed as the run its tickets name (`Task.run`).
        run = task.run if task.tickets else self.trust.run_id(task.audits)
        call: WirePush = PushCall(
            step,
            index,
            Crossing(codec.encode(ids, "inputs")),  # stage 0's inputs are the ids themselves
            codec.encode(labels, "targets"),
            accumulate=tuple(sorted(stages)),
            route=tuple(self._route()),
            run=run,
        )
        peer, result = await self.hops.accumulating(
            0,
            lambda c, a: c.push(call.trying(a), timeout=timeout),
            accumulate=True,
            need_result=False,
            # A push passes its work on before stage 0's backward may refuse it (a stale epoch,
            # a run held there under another): the stages after may hold it, as a replica's
            # own push on reads it (`next_hop`). Given back, not pushed again elsewhere.
            landed=any_error,
        )
        if result is None:  # counted by the hop, once for the whole path
            return MicrobatchResult(step, index, {}, None, int(ids.shape[0]))
        holders = {
            r.stage: r.peer
            for r in named(result.receipts, 0, peer or "")
            if r.stage in stages and r.stage not in result.uncertain
        }
        self.metrics.unreported.inc(len(stages) - len(holders))
        loss = result.loss_sum if last in holders else None
        samples = int(ids.shape[0])
        chain = (peer or "", *result.path)
        whole = len(chain) == last + 1 and all(chain)
        if run and whole:
            touched, stage_runs = tuple(sorted(set(chain))), len(chain)
            done = MicrobatchResult(
                step, index, holders, loss, samples, touched=touched, stage_runs=stage_runs
            )
            if self.trust.defers(task):
                # Reported now, its audit ending off the step's critical path: a liar caught
                # then is banned, and the ban's rollback replays the committed step away
                # (issue 69; `client.audit.late_audits`).
                self.trust.later(
                    done,
                    lambda: self.trust.audited(
                        task, run, chain, holders, ids, labels, result.loss_sum
                    ),
                )
                # But not past this step's commit: the steps before's audits end before this
                # one is reported, so none outlives its bound (step + 1's commit) to be cut,
                # nor a contribution it digests judged without it there. A liar whose lies'
                # audits lagged on a slow machine was never judged (docs/decisions.md, "A
                # late audit ends before the next step commits").
                await self.trust.settled(step)
                return done
            # Audited before it is reported: the job's last step has no next to bound it.
            verdicts, runs, digests = await self.trust.audited(
                task, run, chain, holders, ids, labels, result.loss_sum
            )
            if step >= self.job.training.steps - 1:  # the job's last: no late audit after it
                await self.trust.settled(step)
            return replace(done, verdicts=verdicts, audit_runs=runs, digests=tuple(digests))
        if not rule_of(self.job).rounds or not whole:
            # pool.mode = "local" needs the whole path: without it, nothing of the run counts
            holders = {} if rule_of(self.job).rounds else holders
            return MicrobatchResult(step, index, holders, loss, samples)
        # Each stage ran the microbatch's Forward and its Backward itself: `back` is empty.
        return MicrobatchResult(step, index, holders, loss, samples, chain)

    async def evaluate(
        self, task: Task, ids: torch.Tensor, labels: torch.Tensor
    ) -> MicrobatchResult:
        step, index = task.step, task.index
        call: WirePush = PushCall(
            step,
            index,
            Crossing(codec.encode(ids, "inputs")),
            codec.encode(self._narrow(labels), "targets"),
            route=tuple(self._routes),
            evaluate=True,
        )
        timeout = self._timeout()
        _, pushed = await self.hops.any(0, lambda c: c.push(call, timeout=timeout))
        return MicrobatchResult(step, index, {}, pushed.loss_sum, int(ids.shape[0]))
