"""Giving peers their stages: the scheduler's placement loops and the assignments it publishes.

`place` waits until every stage of a job has a serving replica, assigning measured peers; `grow`
gives peers that join a running job a stage; `assign` publishes one assignment (rebalancing moves
go through it too). Who goes where is `swarm.policy.placement.place_new`'s decision (every stage
gets the job's `min_replicas`, `floor`, before any gets more); who is there is the
`PeerRegistry`'s. A relayed peer (behind NAT) is placed at the share of its speed its path
carries (`placement.path_speeds`); an unreachable one is not placed, and while a job waits for
peers its message names those nobody can dial, with the remedy. Placement spreads each stage's
replicas over distinct hosts and routers where it costs little throughput (the peers' failure
domains, `PeerRegistry.domains`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Container

from scheduler.build_crashes import BuildCrashes
from scheduler.no_shows import NoShows
from scheduler.registry import PeerRegistry
from scheduler.stall_words import REMEDY, stages_text
from scheduler.stalls import Health
from scheduler.waiting_words import Present, refusal, refused_words, unreachable_words
from swarm.bus.connection import BusLike
from swarm.deadline import within
from swarm.job.config import JobConfig
from swarm.net.seats import MAX_SEATS, seat
from swarm.policy.placement import path_speeds, place_new
from swarm.proto import control_pb2 as cpb
from swarm.rpc.lease import Replica

__all__ = ["Assignments"]

log = logging.getLogger(__name__)

#: `say(job_id, message)`: tell `swarm status` what the job waits for.
Say = Callable[[str, str], Awaitable[None]]


class Assignments:
    def __init__(
        self,
        registry: PeerRegistry,
        bus: BusLike,
        say: Say,
        *,
        grace_s: float,
        serve_timeout_s: float,
        lost_stage_grace_s: float,
        health: Callable[[str], Health] = lambda _: Health(),
        min_replicas: int = 1,
        banned: Callable[[str], Container[str]] = lambda _: (),
    ) -> None:
        """`grace_s`: once enough peers are measured, wait this long for more; `serve_timeout_s`:
        assigned peers must serve within this, else the stages are placed again;
        `lost_stage_grace_s`: a trained job's unserved stage waits this long for a replica with
        the trained state before fresh peers take it (and the job rolls back); `health(job)`:
        where `place` keeps since when the job waits; `min_replicas`: the floor of jobs that
        set none (`floor`); `banned(job)`: the ids barred from a job, as its coordinators bar
        them (`BarredIds`): a stage only they serve has no replica, and they are given none."""
        self.registry, self.bus, self.say, self.health = registry, bus, say, health
        self.grace_s = grace_s
        self.serve_timeout_s = serve_timeout_s
        self.lost_stage_grace_s = lost_stage_grace_s
        self.min_replicas = min_replicas
        self.banned = banned
        # peer -> (job, stage, clock time) of its last assignment, until it serves there
        self._sent: dict[str, tuple[str, int, float]] = {}
        self._held_back: set[str] = set()  # peers not placed for their host's seats, said
        self.no_shows = NoShows(serve_timeout_s)  # peers given stages they did not serve
        self.crashes = BuildCrashes(registry.clock)  # peers gone while building their stage
        self.changed = asyncio.Event()  # set by whoever feeds the registry announcements

    def reached(self, report: cpb.ReachabilityReport) -> None:
        """A peer's dial-back (`scheduler.reachability`): kept, and placement looks again (a
        peer checked may be placed now)."""
        self.registry.reached(report)
        self.changed.set()

    def floor(self, job: JobConfig) -> int:
        """The replicas every stage of `job` gets before any gets more, and keeps under
        rebalancing: its `runtime.min_replicas`, else the scheduler's `--min-replicas`."""
        return job.runtime.min_replicas or self.min_replicas

    async def place(
        self,
        job_id: str,
        stages: int,
        step: Callable[[], int],
        assigned: list[str],
        min_replicas: int = 1,
    ) -> None:
        """Wait until every stage has a serving replica, assigning measured peers. `step()`: the
        job's committed step (its trained state lives on its servers once above 0); `assigned`
        collects every peer given a stage; `min_replicas`: the job's `floor`."""
        lost_since: float | None = None
        waiting = self.health(job_id)
        try:
            while True:
                serving = self._serving(job_id, stages)
                missing = [k for k in range(stages) if k not in serving]
                if not missing:
                    return
                if lost_since is None:
                    lost_since = time.monotonic()
                    waiting.waiting_since = time.time()
                held = time.monotonic() - lost_since
                if step() > 0 and held < self.lost_stage_grace_s:
                    # A replica with the trained state may still come back; after the grace
                    # period fresh peers take the stage and the coordinator rolls back to a
                    # checkpoint.
                    until = time.strftime(
                        "%H:%M:%S", time.localtime(waiting.waiting_since + self.lost_stage_grace_s)
                    )
                    await self.say(
                        job_id,
                        f"waiting until {until} for a replica of {stages_text(missing)} with the "
                        f"trained state (the job's servers hold it; --lost-stage-grace-s "
                        f"{self.lost_stage_grace_s:g}); then fresh peers take "
                        f"{'it' if len(missing) == 1 else 'them'} and every stage rolls back to "
                        "the last checkpoint",
                    )
                    await self._change(min(5.0, max(self.lost_stage_grace_s - held, 0.1)))
                    continue
                # a stage a peer is on the way to needs no other (one went away, its stage was
                # placed again at once: `_wait_serving`)
                coming = self.on_the_way(job_id, stages)
                unmet = [k for k in missing if not coming[k]]
                available = self.available(job_id, stages)
                if len(available) < len(unmet):
                    more = len(unmet) - len(available)
                    present = Present.of(self.registry, job_id, stages)
                    enough = present.measuring >= more  # no more servers needed, only time
                    remedy = f"placed once measured ({more} more needed)" if enough else REMEDY
                    await self.say(
                        job_id,
                        f"waiting for peers: {stages_text(missing)} without a replica; this "
                        f"job's {stages} stage(s) need at least {stages} stage server(s), one "
                        f"per stage ({stages - len(missing)} served, {len(available)} more "
                        f"peer(s) measured): {remedy}"
                        + ("" if enough else f" ({more} more)")
                        + present.words()
                        + unreachable_words(self.registry, job_id)
                        + refused_words(self.registry, job_id)
                        + self.no_shows.words(job_id, self._incarnations())
                        + self.crashes.words(job_id),
                    )
                    await self._change(5.0)
                    continue
                await self._settle(job_id, stages)  # let late peers finish measuring
                available = self.available(job_id, stages)
                if len(available) < len(unmet):
                    continue  # some left during the grace period
                await self._assign_available(job_id, available, assigned, min_replicas)
                await self._wait_serving(job_id, missing)
        finally:
            waiting.waiting_since = 0.0

    async def grow(
        self, job_id: str, stages: int, assigned: list[str], min_replicas: int = 1
    ) -> None:
        """While the job trains, peers that join become extra replicas (they copy a live
        replica's state at the next step boundary), of the stages short of `min_replicas` first.
        Runs until cancelled."""
        while True:
            await self._change(5.0)
            if self.available(job_id, stages):
                await self._settle(job_id, stages)
                available = self.available(job_id, stages)
                if available:
                    await self._assign_available(job_id, available, assigned, min_replicas)

    async def assign(
        self, job_id: str, peer: str, stage: int, generation: int | None = None
    ) -> None:
        """Publish `peer`'s stage; `generation` orders assignments (default: now, in µs, which
        grows across scheduler restarts)."""
        if generation is None:
            generation = time.time_ns() // 1000
        message = cpb.Assignment(job=job_id, peer=peer, stage=stage, generation=generation)
        await self.bus.publish(self.bus.topics.assign(job_id, peer), message, retain=True)
        self.registry.assigned(peer, job_id, stage)
        self._sent[peer] = (job_id, stage, self.registry.clock.now())

    def on_the_way(self, job_id: str, stages: int) -> list[list[str]]:
        """Per stage, the peers assigned it that do not serve it yet (building it, or draining
        their old stage), within `serve_timeout_s` of their assignment, still present and not
        refusing the job (a build that failed, said: waited for, it held the stage's place for
        the whole timeout)."""
        now, peers = self.registry.clock.now(), self.registry.peers
        timeout, serving = self.registry.serve_timeout_s, cpb.PEER_STATE_SERVING
        result: list[list[str]] = [[] for _ in range(stages)]
        for peer, (job, stage, at) in list(self._sent.items()):
            there = peers.get(peer)
            arrived = there is not None and (there.state, there.job) == (serving, job)
            refused = refusal(there, job) is not None  # said why: no miss, nothing to wait for
            if there is None or (arrived and there.stage == stage) or now - at > timeout or refused:
                del self._sent[peer]  # arrived, gone, refused, or given up on
                if there is not None and arrived and there.stage == stage:
                    self.no_shows.served(job, peer)
                    self.crashes.served(job, peer)
                elif there is not None and not arrived and not refused:  # dropped it, no word
                    self.no_shows.missed(job, peer, stage, there.incarnation)
                elif there is None:  # went away before it served: stopped, or killed building
                    self.crashes.lost(job, peer, stage)
            elif job == job_id and stage < stages:
                result[stage].append(peer)
        return result

    def available(self, job_id: str, stages: int) -> dict[str, list[float]]:
        """`registry.available`, but for the peers left out after assignments of the job they
        did not serve (`scheduler.no_shows`), counted first."""
        self.on_the_way(job_id, stages)
        self.no_shows.keep(set(self.registry.peers))
        for peer, there in self.registry.peers.items():  # serving it: no miss in a row now
            if (there.state, there.job) == (cpb.PEER_STATE_SERVING, job_id):
                self.no_shows.served(job_id, peer)
                self.crashes.served(job_id, peer)
        incarnations, banned = self._incarnations(), self.banned(job_id)
        return {
            peer: speeds
            for peer, speeds in self.registry.available(job_id, stages).items()
            if not self.no_shows.left_out(job_id, peer, incarnations[peer])
            and not self.crashes.left_out(job_id, peer)
            and peer not in banned
        }

    def _serving(self, job_id: str, stages: int) -> Collection[int]:
        """The stages of `job_id` a replica serves (`registry.serving`), but those served by
        peers banned from the job alone: its coordinators leave them out. (Read from the
        members, a stage whose replica's load reports were late counted as unserved.)"""
        return {k for k in self.registry.serving(job_id, self.banned(job_id)) if k < stages}

    def _incarnations(self) -> dict[str, str]:
        return {peer: a.incarnation for peer, a in self.registry.peers.items()}

    async def withdraw(self, job_id: str, peers: set[str]) -> None:
        """Clear the assignments of an ended job (its announcement frees the peers), all at
        once: with the broker away each waits for it (`publish_timeout_s`), and one after
        another a job's end waited that long per peer."""
        await asyncio.gather(
            *(
                self.bus.publish(self.bus.topics.assign(job_id, peer), b"", retain=True)
                for peer in sorted(peers)
            )
        )
        self.registry.withdrawn(job_id)
        self.no_shows.forget(job_id)
        self.crashes.forget(job_id)
        for peer in [p for p, sent in self._sent.items() if sent[0] == job_id]:
            del self._sent[peer]  # its assignments are void: none is a miss

    async def _assign_available(
        self,
        job_id: str,
        available: dict[str, list[float]],
        assigned: list[str],
        min_replicas: int,
    ) -> None:
        """Every available peer gets a stage: `place` for a job nobody serves; for peers joining
        a running one, the stages short of `min_replicas`, then those that raise the bottleneck
        most (fastest peer first)."""
        # An aggregator (or a relay) serves no stage, whatever else it announces.
        available = {p: s for p, s in available.items() if _stage_server(self.registry, p)}
        if not available:
            return
        stages = len(next(iter(available.values())))
        available = self._priced(available)
        banned = self.banned(job_id)  # no members: their throughput and seats count for nothing
        members = [
            [r for r in stage if r.peer not in banned]
            for stage in self.registry.members(job_id, stages)
        ]
        coming = self.on_the_way(job_id, stages)  # so a burst of joins is not all sent to one
        # None: a first placement (`place`); where peers are on the way already (one of them
        # went away, its stage placed again) the others' stages count as taken
        totals = (
            [sum(self._priced({r.peer: [r.throughput]})[r.peer][0] for r in s) for s in members]
            if any(members) or any(coming)
            else None
        )
        sizes = [len(stage) + len(more) for stage, more in zip(members, coming, strict=True)]
        # said once each while it is known: not every id ever held back (a token holder makes
        # up ids on one host freely; the registry keeps those present only)
        self._held_back &= self.registry.peers.keys()
        there = [
            [r.peer for r in stage] + more for stage, more in zip(members, coming, strict=True)
        ]
        # A peer back under its id (restarted) finds the stage it was given retained on the
        # broker and builds it: while every stage is served and it can serve that one, it keeps
        # it (decided once: placed anew, it would build one stage and then move to another).
        kept: dict[str, int] = {}
        if totals is not None and all(t > 0.0 for t in totals):
            for peer, speeds in sorted(available.items()):
                stage = self.registry.given(job_id, peer)
                if stage is not None and stage < stages and speeds[stage] > 0.0:
                    kept[peer] = stage
                    totals[stage] += speeds[stage]
                    sizes[stage] += 1
                    there[stage].append(peer)
        rest = {peer: speeds for peer, speeds in available.items() if peer not in kept}
        domains = self.registry.domains()
        try:
            placed = (
                place_new(
                    rest,
                    stages,
                    totals,
                    min_replicas=min_replicas,
                    sizes=sizes,
                    domains=domains,
                    members=there,
                )
                if rest
                else {}
            )
        except (ArithmeticError, ValueError) as e:  # no announced number fails a job (issue 64)
            log.warning("job %s: no placement of %s (%r): they wait", job_id, sorted(rest), e)
            placed = {}
        placement = self._capped(dict(sorted((kept | placed).items())), members, coming)
        await self._publish(job_id, placement, available, assigned)

    async def _publish(
        self,
        job_id: str,
        placement: dict[str, int],
        speeds: dict[str, list[float]],
        assigned: list[str],
    ) -> None:
        """Give each peer of `placement` its stage (one generation for them all), each logged
        with its samples/s there (`speeds`), kept in `assigned`; said as the job's message."""
        generation = time.time_ns() // 1000  # one for the whole placement
        for peer, stage in sorted(placement.items()):
            log.info(
                "job %s: stage %d -> %s (%.1f samples/s)", job_id, stage, peer, speeds[peer][stage]
            )
            await self.assign(job_id, peer, stage, generation)
            assigned.append(peer)
        where = ", ".join(f"{peer} on stage {stage}" for peer, stage in sorted(placement.items()))
        await self.say(job_id, f"starting {len(placement)} stage server(s): {where}")

    def _capped(
        self, placement: dict[str, int], members: list[list[Replica]], coming: list[list[str]]
    ) -> dict[str, int]:
        """`placement` less the peers whose host holds `MAX_SEATS` seats of the stage given them
        already (`swarm.net.seats`; issue 64: two ids of one token holder in one stage outvote
        its third replica in the audits). They wait, logged; another host's peer takes it."""

        def host(peer: str) -> str:
            p = self.registry.peers.get(peer)
            return seat(self.registry.dial_address(p) if p is not None else "", peer)

        there = [
            [r.peer for r in stage] + more for stage, more in zip(members, coming, strict=True)
        ]
        held = Counter(
            (k, host(p)) for k, peers in enumerate(there) for p in peers if p not in placement
        )
        out = {}
        for peer, stage in placement.items():
            if held[(stage, host(peer))] >= MAX_SEATS:
                if peer in self._held_back:
                    continue
                self._held_back.add(peer)  # said once: it is offered each placement again
                log.warning(
                    "peer %s is not placed on stage %d: its host %s holds a seat there already",
                    peer,
                    stage,
                    host(peer),
                )
                continue
            held[(stage, host(peer))] += 1
            out[peer] = stage
        return out

    def _priced(self, speeds: dict[str, list[float]]) -> dict[str, list[float]]:
        """`speeds` as placement counts them: a relayed peer's at its path's share."""
        return path_speeds(speeds, {p: None for p in speeds if self.registry.relayed(p)})

    async def _wait_serving(self, job_id: str, stages: list[int]) -> None:
        """Until `stages` serve, at most `serve_timeout_s`; over at once where a stage that had
        peers on the way has none any more (they went away: `BuildCrashes`), to be placed
        again."""
        deadline = time.monotonic() + self.serve_timeout_s
        count = max(stages) + 1
        given = [k for k, peers in enumerate(self.on_the_way(job_id, count)) if peers]
        while time.monotonic() < deadline:
            serving = self._serving(job_id, count)
            coming = self.on_the_way(job_id, count)  # arrivals recorded: served, none lost
            if all(k in serving for k in stages):
                return
            if any(k not in serving and not coming[k] for k in given):
                return
            await self._change(1.0)
        log.warning(
            "job %s: stages %s not serving after %.0fs; placing again",
            job_id,
            stages,
            self.serve_timeout_s,
        )

    async def _settle(self, job_id: str, stages: int) -> None:
        """The grace before a placement: at most `grace_s`, and over as soon as no free stage
        server may still be measuring `job_id` (each has announced its figures, or serves). It
        waits for peers measuring the job; with every peer it knows measured, a fixed wait only
        delayed the job's start (2 s each placement)."""
        deadline = time.monotonic() + self.grace_s
        while _measuring(self.registry, job_id, stages):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            await self._change(left)

    async def _change(self, timeout: float) -> None:
        """Wait for an announcement since the last wake-up, at most `timeout` seconds. Cleared
        when it wakes, not when it starts waiting: one that came while the caller read the
        registry or spoke is not lost (it returns at once, and the caller reads again)."""
        with contextlib.suppress(TimeoutError):
            await within(self.changed.wait(), timeout)
        self.changed.clear()


def _stage_server(registry: PeerRegistry, peer: str) -> bool:
    announced = registry.peers.get(peer)
    return announced is not None and announced.role == cpb.PEER_ROLE_STAGE_SERVER


def _measuring(registry: PeerRegistry, job_id: str, stages: int) -> bool:
    """Whether a free stage server may still be measuring `job_id`: it announces its figures
    once measured, and is free (joining, of no other job) until then."""
    return any(
        p.role == cpb.PEER_ROLE_STAGE_SERVER
        and p.state == cpb.PEER_STATE_JOINING
        and p.job in ("", job_id)
        and not all(k in p.samples_per_second for k in range(stages))
        for p in registry.peers.values()
    )
