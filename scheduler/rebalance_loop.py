"""The scheduler's moves of peers between a job's stages, both decided by the policy's `Rebalancer`
(the simulator's too) and published as new assignments:
- every period, on the registry's measured view of the job, the move that raises the bottleneck
  (`Mover.run`);
- at once, when a stage has lost its last replica (the job stalls: no microbatch crosses it), a
  spare for it (`Mover.refill`, called by the job's `StallWatch` as it sees the stage empty): an
  idle peer measured for the job, else a replica of a stage with more than it needs
  (`swarm.policy.rebalance.plan_refill`). What it does is what the stall's message says, so the
  remedy shown is the scheduler's own when it has one;
- in a period with no such move, a spare replica of one stage (the job loses nothing without it,
  `swarm.policy.spares`) to a stage that wants a standby none of its own peers may be, on a host
  that holds none of that stage's replicas: it stands by there (`Mover.stand_by`, issue 67).
The moved peer drains; what it held at its old stage is replayed; it copies its new stage's state
at a step boundary (an emptied stage's from the last checkpoint, as every stage rolls back)."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Collection

from prometheus_client import Counter

from scheduler.assignments import Assignments
from scheduler.waiting_words import refusal
from swarm.job.config import RebalanceConfig
from swarm.ops.printable import quoted
from swarm.policy.domains import Domains
from swarm.policy.rebalance import Move, Rebalancer
from swarm.policy.spares import spare

__all__ = ["Mover"]

log = logging.getLogger(__name__)


class Mover:
    def __init__(
        self,
        job_id: str,
        stages: int,
        config: RebalanceConfig,
        assignments: Assignments,
        moves: Counter,
        min_replicas: int = 1,
        standbys: Callable[[], Collection[str]] = lambda: (),
        short: Callable[[], list[int]] = lambda: [],
    ) -> None:
        """`moves` counts the moves ordered (label `job`); `min_replicas`: the job's floor, which
        no move to the bottleneck takes a stage below. With `config.enabled` false no replica
        is moved (an idle peer still takes an emptied stage at once)."""
        self.job_id, self.stages, self.config = job_id, stages, config
        self.assignments, self.moves = assignments, moves
        self.rebalancer = Rebalancer(config, min_replicas)
        # The job's standbys (`scheduler.coordinator.standbys`), and the peers banned from it:
        # no replica to move or to count as one, and no work measured.
        self.standbys = standbys
        # The stages that want a standby none of their own peers may be (`Standbys.short`).
        self.short = short
        # stage -> (the peer sent to fill it, what was done in words, clock time it was sent)
        self._filling: dict[int, tuple[str, str, float]] = {}
        # stage nobody serves -> the peer last sent to fill it that refused the job, and why
        # (its build failed: out of memory, a full disk), until another is sent or it is
        # served; and when it refused
        self._refusals: dict[int, tuple[str, float]] = {}

    async def run(self) -> None:
        """Rebalance every `period_s` until cancelled."""
        registry = self.assignments.registry
        while True:
            await asyncio.sleep(self.config.period_s)
            measured = registry.measured(self.job_id, self.stages, self.standbys())
            now = registry.clock.now()
            if measured is None:  # decide on measured throughput only: every member's report
                await self.stand_by(now)  # a standby's spare is judged on announced speeds
                continue
            assignment, speeds = measured
            move = self.rebalancer.decide(assignment, speeds, self.stages, now, registry.domains())
            if move is None:
                await self.stand_by(now)
                continue
            await self._order(move, "rebalancing")
            if move.dst not in assignment.values():  # an empty stage: `refill` need not send more
                what = f"moving {move.peer} from stage {move.src} (a spare replica)"
                self._filling[move.dst] = (move.peer, what, now)

    async def stand_by(self, now: float) -> None:
        """One spare replica (the job loses nothing without it, counting the standbys out) to
        the first stage in `short` that one may stand by for: its host holds none of that
        stage's replicas, it has not moved within `min_dwell_s`; one behind a router none of
        them is behind first, then the slowest. It arrives as a joiner the job does not need,
        and the coordinator makes it the stage's standby (a spare first). None with rebalancing
        off (`config.enabled`): it forbids moving replicas between stages, and this is a move
        (docs/decisions.md, "Standbys where the swarm has room")."""
        short = self.short()
        if not short or not self.config.enabled:
            return
        speeds, coming = self._placed()
        out, domains = set(self.standbys()), self.assignments.registry.domains()
        none = Domains(host="", router="")

        def host(peer: str) -> str:
            return domains.get(peer, none).host or f"peer:{peer}"

        for dst in [k for k in short if not coming[k]]:  # one on its way may stand by there
            there = [p for p in speeds[dst] if p not in out]
            hosts = {host(p) for p in there}
            routers = {domains.get(p, none).router for p in there} - {""}
            fits = [
                (domains.get(peer, none).router in routers, stage[peer], peer, src)
                for src, stage in enumerate(speeds)
                for peer in stage
                if src != dst
                and peer not in out
                and host(peer) not in hosts
                and now - self.rebalancer.last_moved.get(peer, -math.inf) >= self.config.min_dwell_s
                and self._spare_there(speeds, out, peer, src, dst)
            ]
            if not fits:
                continue
            *_, peer, src = min(fits)
            log.warning(
                "job %s: stage %d wants a standby: moving spare replica %s from stage %d to "
                "stand by for it (the job loses nothing without it)",
                self.job_id,
                dst,
                peer,
                src,
            )
            self.moves.labels(job=self.job_id).inc()
            self.rebalancer.last_moved[peer] = now
            await self.assignments.assign(self.job_id, peer, dst)
            return  # one move a period, as rebalancing's

    def _placed(self) -> tuple[list[dict[str, float]], list[list[str]]]:
        """Each stage's peers with their samples/s there, those on their way to a stage counted
        there (as `_move_spares` counts them), and those on their way."""
        registry = self.assignments.registry
        members = registry.members(self.job_id, self.stages)
        speeds = [{r.peer: r.throughput for r in stage} for stage in members]
        coming = self.assignments.on_the_way(self.job_id, self.stages)
        for k, peers in enumerate(coming):
            for peer in peers:
                for placed in speeds:
                    placed.pop(peer, None)
                announced = registry.peers.get(peer)
                speeds[k][peer] = announced.samples_per_second.get(k, 0.0) if announced else 0.0
        return speeds, coming

    def _spare_there(
        self, speeds: list[dict[str, float]], out: set[str], peer: str, src: int, dst: int
    ) -> bool:
        """Whether the job loses nothing without `peer` where it is (`src`) and, moved, at
        `dst` (where it can serve): else the bottleneck needs it there as a replica, which is
        rebalancing's move to make, and it would not stand by."""
        floor, announced = self.rebalancer.min_replicas, self.assignments.registry.peers.get(peer)
        there = announced.samples_per_second.get(dst, 0.0) if announced is not None else 0.0
        if there <= 0.0 or not spare(speeds, out | {peer}, floor):
            return False
        moved = [{p: v for p, v in stage.items() if p != peer} for stage in speeds]
        moved[dst][peer] = there
        return spare(moved, out | {peer}, floor)

    async def refill(self, missing: list[int]) -> dict[int, str]:
        """Send a spare to each of the `missing` stages (those nobody serves) not being filled
        already; returns, for each missing stage being filled, what was done, in words ("moving
        peer3 from stage 2 (a spare replica)"). A stage absent from it has no spare: starting
        a stage server is the remedy."""
        registry = self.assignments.registry
        now = registry.clock.now()
        for k, (peer, _, at) in list(self._filling.items()):
            why = refusal(registry.peers.get(peer), self.job_id)
            if why is not None and k in missing:  # said at once: it never serves
                said = f"{peer}, sent to it, refused the job: {quoted(why)}"
                self._refusals[k] = (said, now)
                log.warning("job %s: stage %d has no replica: %s", self.job_id, k, said)
            if (
                k not in missing
                or peer not in registry.peers
                or now - at > registry.serve_timeout_s
                or why is not None
            ):
                del self._filling[k]  # served, or the peer sent is gone, refused or never came
        coming = self.assignments.on_the_way(self.job_id, self.stages)
        for k in missing:  # sent there by placement (a peer that joined) or a move meanwhile
            if k not in self._filling and coming[k]:
                self._filling[k] = (coming[k][0], f"giving it to {coming[k][0]} (joining)", now)
        todo = [k for k in missing if k not in self._filling]
        if todo:
            await self._send_idle(todo, now)
            todo = [k for k in todo if k not in self._filling]
        # A spare replica moved there that refused it (the stage does not fit such a peer, say)
        # left the job with its old stage; the next is moved once `serve_timeout_s` has
        # passed, as before, not at the next look: one a timeout, not the stage's every spare.
        timeout = registry.serve_timeout_s
        todo = [k for k in todo if now - self._refusals.get(k, ("", -math.inf))[1] > timeout]
        if todo and self.config.enabled:
            await self._move_spares(todo, now)
        self._refusals = {
            k: r for k, r in self._refusals.items() if k in missing and k not in self._filling
        }
        return {k: what for k, (_, what, _) in self._filling.items() if k in missing}

    @property
    def refused(self) -> dict[int, str]:
        """Of the stages nobody serves, those whose peer sent refused the job, in words, until
        another is sent or the stage is served."""
        return {k: said for k, (said, _) in self._refusals.items()}

    async def _send_idle(self, todo: list[int], now: float) -> None:
        """Idle peers measured for the job take the empty stages, the fastest at each."""
        idle = self.assignments.available(self.job_id, self.stages)
        for k in todo:
            able = [p for p, row in idle.items() if row[k] > 0.0]
            if not able:
                continue
            peer = max(able, key=lambda p: (idle[p][k], p))
            del idle[peer]
            log.warning(
                "job %s: stage %d has no replica: idle peer %s takes it", self.job_id, k, peer
            )
            await self.assignments.assign(self.job_id, peer, k)
            self._filling[k] = (peer, f"giving it to idle peer {peer}", now)

    async def _move_spares(self, todo: list[int], now: float) -> None:
        """Spare replicas move to the empty stages (`Rebalancer.refill`), on the speeds the
        peers announced (a stall cannot wait for every member's measurement)."""
        registry = self.assignments.registry
        members = registry.members(self.job_id, self.stages)
        standbys = self.standbys()  # no replica: neither a spare to move nor one a stage keeps
        assignment = {r.peer: k for k, reps in enumerate(members) for r in reps}
        assignment = {p: k for p, k in assignment.items() if p not in standbys}
        coming = self.assignments.on_the_way(self.job_id, self.stages)
        sent = [(p, k) for k, peers in enumerate(coming) for p in peers]
        for peer, k in [*sent, *((p, k) for k, (p, _, _) in self._filling.items())]:
            assignment[peer] = k  # on its way there: it fills that stage, and is no spare
        speeds = {
            p: [registry.peers[p].samples_per_second.get(j, 0.0) for j in range(self.stages)]
            for p in assignment
            if p in registry.peers
        }
        assignment = {p: k for p, k in assignment.items() if p in speeds}
        domains = registry.domains()
        for move in self.rebalancer.refill(assignment, speeds, self.stages, now, domains):
            if move.dst in todo:
                await self._order(move, "its stage's spare")
                self._filling[move.dst] = (
                    move.peer,
                    f"moving {move.peer} from stage {move.src} (a spare replica)",
                    now,
                )

    async def _order(self, move: Move, why: str) -> None:
        self.moves.labels(job=self.job_id).inc()
        if move.before > 0.0:
            log.warning(
                "job %s: %s: moving %s from stage %d to stage %d (bottleneck %.1f -> %.1f "
                "samples/s)",
                self.job_id,
                why,
                move.peer,
                move.src,
                move.dst,
                move.before,
                move.after,
            )
        else:
            log.warning(
                "job %s: stage %d has no replica: moving %s from stage %d to it (%s)",
                self.job_id,
                move.dst,
                move.peer,
                move.src,
                why,
            )
        await self.assignments.assign(self.job_id, move.peer, move.dst)
