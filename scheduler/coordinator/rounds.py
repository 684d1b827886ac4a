"""The coordinator's side of `pool.mode = "local"` (`stage_server.local_round` is the replica's).

Every step commits as in "step" mode, except that each replica's PREPARE averages with no one
(its group is itself) over its own samples: each applies its own local update. After the step
that ends a round (`is_boundary`), every pool averages its members' pseudo-gradients and takes
the outer step, in two phases as a step does: PREPARE everywhere (each member weighs its
pseudo-gradient by its samples in the round, the pool sums them over the group's samples), then
APPLY everywhere, so no member moves on until every pool has averaged.

A member that fails the round (dead, or named by the others as the one they could not reach) is
dropped and the round repeats without it: its local steps of the round are lost with it, and
its samples of the round are counted (`swarm_coordinator_round_dropped_samples_total`, a log
line), not replayed (replaying them would count them twice at every other stage, whose replicas
have applied them already; docs/jobs.md, "Pool modes").

The route record (`swarm.model.routes`) is written here too: the runs each step counted, each
round's group, and the members the job started with.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable

from scheduler.coordinator.commit import CommitStalled, culprits
from scheduler.coordinator.ledger import StepLedger
from scheduler.coordinator.membership import Membership
from scheduler.coordinator.metrics import CoordinatorMetrics
from scheduler.coordinator.replicas import ReplicaClients
from swarm.errors import Aborted
from swarm.job.config import JobConfig
from swarm.model.optim import is_boundary
from swarm.model.routes import Join, Record, StepRuns, Sync
from swarm.policy.backoff import Backoff
from swarm.rpc.lease import Replica

__all__ = ["PoolRounds"]

log = logging.getLogger(__name__)


class PoolRounds:
    def __init__(
        self,
        job: JobConfig,
        clients: ReplicaClients,
        membership: Membership,
        metrics: CoordinatorMetrics,
        on_record: Callable[[Record], None] | None = None,
        on_status: Callable[[str], Awaitable[None] | None] | None = None,
    ) -> None:
        """`on_record`: the route record's sink; `on_status(text)`: what `swarm status` should
        say (a round that dropped a replica's samples)."""
        self.job, self.clients, self.membership, self.metrics = job, clients, membership, metrics
        self.on_record = on_record or (lambda record: None)
        self.on_status = on_status
        self.dropped = 0  # samples dropped with the replicas that left mid-round, so far
        self._samples: Counter[tuple[int, str]] = Counter()  # (stage, peer) -> in this round

    def started(self, step: int, members: list[list[Replica]]) -> None:
        """The job starts (or resumes) at `step` with `members`: a round starts here."""
        self._samples.clear()
        for stage, replicas in enumerate(members):
            for r in replicas:
                self.on_record(Join(step, stage, r.peer, None))

    def joined(self, step: int, stage: int, peer: str, source: str) -> None:
        """`peer` became a member of `stage` at `step` (a round's start), a copy of `source`."""
        self.on_record(Join(step, stage, peer, source or None))

    def starts_round(self, step: int) -> bool:
        """Whether a round starts at step `step` (a replica may join only there)."""
        return step == 0 or is_boundary(self.job, step)

    def applied(self, ledger: StepLedger) -> None:
        """`ledger`'s step was applied: its runs go on the record, its samples to the round."""
        self.on_record(StepRuns(ledger.step, tuple(ledger.runs())))
        for stage in range(ledger.stages):
            for peer in ledger.holdings(stage):
                self._samples[(stage, peer)] += ledger.samples_held(stage, peer)

    def ends_round(self, step: int) -> bool:
        """Whether step `step`'s commit ends a round."""
        return is_boundary(self.job, step + 1)

    async def end(self, step: int) -> None:
        """End the round after step `step` on every pool; retried without the members that
        fail it, at most `runtime.max_commit_rounds` times. While a stage has no member it
        waits (the coordinator rolls back once one is back, cancelling this)."""
        boundary, failures, wait = step + 1, 0, Backoff(first_s=0.1, cap_s=2.0)
        bound = self.job.runtime.max_commit_rounds
        while True:
            members = self.membership.replicas()
            if any(not replicas for replicas in members):
                await wait.sleep()
                continue
            reason = await self._prepare(boundary, members, f"{step}/round{failures}")
            if reason is None:
                break
            failures += 1
            self.metrics.aborted_rounds.inc()
            if failures >= bound:
                raise CommitStalled(
                    f"the round after step {step}: {failures} averaging rounds failed "
                    f"(runtime.max_commit_rounds = {bound}); the last: {reason}"
                )
            await wait.sleep()
        where = [(stage, r) for stage, replicas in enumerate(members) for r in replicas]
        results = await asyncio.gather(
            *(self.clients.get(stage, r).apply_round(boundary) for stage, r in where),
            return_exceptions=True,
        )
        for (stage, r), result in zip(where, results, strict=True):
            if isinstance(result, BaseException):  # it rejoins by copying, as after a step
                log.warning("round after step %d: apply on %s (stage %d) failed: %s",
                            step, r.peer, stage, result)  # fmt: skip
        for stage, replicas in enumerate(members):
            self.on_record(Sync(step, stage, tuple(r.peer for r in replicas)))
        said = self._count_dropped(step, members)
        if said and self.on_status is not None:
            shown = self.on_status(said)
            if shown is not None:
                await shown

    async def _prepare(
        self, boundary: int, members: list[list[Replica]], round_id: str
    ) -> str | None:
        """PREPARE the round on every member; None when every one averaged, else why not
        (the members that failed it are dropped by then)."""
        where, calls = [], []
        for stage, replicas in enumerate(members):
            group = [r.address for r in replicas]
            total = sum(self._samples[(stage, r.peer)] for r in replicas)
            for index, r in enumerate(replicas):
                where.append((stage, r))
                calls.append(
                    self.clients.get(stage, r).prepare_round(
                        boundary, total, group, index, round_id
                    )
                )
        results = await asyncio.gather(*calls, return_exceptions=True)
        failed = [(k, r, e) for (k, r), e in zip(where, results, strict=True)
                  if isinstance(e, BaseException)]  # fmt: skip
        if not failed:
            return None
        accusations: dict[int, dict[int, set[int]]] = {}
        for stage, r, error in failed:
            log.warning("round %s at stage %d failed on %s: %r", round_id, stage, r.peer, error)
            if isinstance(error, Aborted) and error.missing:
                accusations.setdefault(stage, {})[members[stage].index(r)] = set(error.missing)
            elif not isinstance(error, Aborted):  # it failed by itself: gone, or refused
                self.membership.drop(r.peer)
        for stage, named in accusations.items():
            for i in culprits(members[stage], named, {}):
                self.membership.drop(members[stage][i].peer)
        return "; ".join(f"stage {k} {r.peer}: {type(e).__name__}: {e}" for k, r, e in failed)

    def _count_dropped(self, step: int, members: list[list[Replica]]) -> str:
        """Count the samples of the replicas that left mid-round; a line for `swarm status`
        ("" when none did)."""
        kept = {(stage, r.peer) for stage, replicas in enumerate(members) for r in replicas}
        said = []
        for (stage, peer), samples in sorted(self._samples.items()):
            if (stage, peer) not in kept and samples:
                self.metrics.round_dropped.inc(samples)
                self.dropped += samples
                said.append(f"stage {stage}: {peer} left mid-round, {samples} samples dropped")
                log.warning(
                    "round after step %d: stage %d: %s left before the round's end: its %d "
                    "samples of the round are not in the pool's average",
                    step,
                    stage,
                    peer,
                    samples,
                )
        self._samples.clear()
        if not said:
            return ""
        return (
            f"round after step {step}: " + "; ".join(said) + f" ({self.dropped} in all: a "
            "replica's local steps leave with it; the pool averaged without them)"
        )
