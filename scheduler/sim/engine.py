"""The discrete-event engine: one heap of timed events, the real policies, simulated peers.

Drives `swarm.policy.wiring.Wiring` (one per trainer, on the simulated clock), and through
`registry`
the scheduler's own calls: `swarm.policy.placement.place_new` (the initial peers, each joining peer)
and `swarm.policy.rebalance.Rebalancer` (every period, and at once when a departure leaves a stage
with no replica assigned, with `policy="swarm"`).
Randomness comes from `random.Random` streams seeded from `config.seed` only, so a config gives
the same numbers every time. Two shortcuts keep it one event per hop: the trainer acts on a reply
when the replica finishes (the reply's latency is added to the next hop's), and a task joins its
next replica's FIFO queue when sent, starting no earlier than it arrives. See `model` for the
task abstraction, `report` for what is measured.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from typing import Any

from scheduler.sim.meter import Meter
from scheduler.sim.model import (
    SEED_PREFIX,
    PeerState,
    SimClock,
    SimConfig,
    SimPeer,
    SimTask,
    class_affinity,
    hop_stage,
    hop_work,
    new_peer,
)
from scheduler.sim.registry import Registry
from scheduler.sim.report import Summary
from swarm.policy.domains import Domains
from swarm.policy.rebalance import Move
from swarm.policy.wiring import NoReplicaError, Wiring

__all__ = ["Simulation", "simulate"]

_DONE, _RETRY, _READY, _DEPART, _JOIN, _REBALANCE, _LOAD, _SAMPLE, _WINDOW = range(9)


def simulate(config: SimConfig) -> Summary:
    return Simulation(config).run()


class Simulation:
    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.clock = SimClock()
        seed, stages = config.seed, config.stages
        self._churn = random.Random(f"{SEED_PREFIX}/{seed}/churn")
        self._affinity = class_affinity(config)
        self._samples = config.task_samples
        hops = range(2 * stages - 1)
        self._hop_stage = [hop_stage(h, stages) for h in hops]
        self._hop_work = [hop_work(h, stages, config.forward_share) for h in hops]
        self._trainers = [
            Wiring(
                stages,
                clock=self.clock,
                rng=random.Random(f"{SEED_PREFIX}/{seed}/wiring/{i}"),
                config=config.wiring,
                task_samples=config.task_samples,
            )
            for i in range(config.trainers)
        ]
        self._events: list[tuple[float, int, int, Any, int]] = []  # (time, seq, kind, what, epoch)
        self._seq = 0
        self._peers: dict[str, SimPeer] = {}  # present peers
        self._named = 0
        self.registry = Registry(stages, config.rebalance_config, config.min_replicas)
        self.meter = Meter(stages)

    def run(self) -> Summary:
        config, started = self.config, time.perf_counter()
        end = config.hours * 3600.0
        self._start_peers()
        inflight = max(1, round(config.inflight_per_peer * config.peers / config.trainers))
        for trainer in range(config.trainers):
            for i in range(inflight):  # spread along the pipeline: no fill-up to wait for
                self._route(SimTask(trainer, hop=i % len(self._hop_stage)), 0.0, 0.0)
        if config.joins_per_hour > 0.0:
            self._push(self._churn.expovariate(config.joins_per_hour / 3600.0), _JOIN, None)
        if config.policy == "swarm" and config.stages > 1:
            self._push(config.rebalance_config.period_s, _REBALANCE, None)
        if config.trainers > 1:
            self._push(config.load_report_s, _LOAD, None)
        self._push(0.0, _SAMPLE, None)
        for k in range(1, math.ceil(end / config.window_s) + 1):
            self._push(min(k * config.window_s, end), _WINDOW, None)
        events = self._loop(end)
        totals = self.meter.totals
        return Summary(
            policy=config.policy,
            peers=config.peers,
            stages=config.stages,
            hours=config.hours,
            seed=config.seed,
            windows=self.meter.windows,
            joins=totals["joins"],
            departures=totals["departures"],
            moves=totals["moves"],
            failed_hops=totals["failed_hops"],
            events=events,
            wall_s=time.perf_counter() - started,
        )

    def _loop(self, end: float) -> int:
        events, clock, handled = self._events, self.clock, 0
        while events:
            t, _, kind, what, epoch = heapq.heappop(events)
            clock.t = t
            handled += 1
            if kind == _DONE:
                if what.epoch == epoch:  # else the peer crashed meanwhile
                    self._done(what, t)
            elif kind == _RETRY:
                self._route(what, t, 0.0)
            elif kind == _READY:
                if what.epoch == epoch and what.state == PeerState.DOWNLOADING:
                    self._ready(what, t)
            elif kind == _DEPART:
                self._depart(what, t)
            elif kind == _JOIN:
                self._join(t)
            elif kind == _REBALANCE:
                self._rebalance(t)
            elif kind == _LOAD:
                self._report_loads(t)
            elif kind == _SAMPLE:
                self._sample(t)
            elif kind == _WINDOW:
                self.meter.close(t, self._peers.values(), len(self._peers))
                if t >= end:
                    break
        return handled

    def _push(self, t: float, kind: int, what: Any, epoch: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, what, epoch))

    # -- the data path ----------------------------------------------------------------------------

    def _route(self, task: SimTask, t: float, delay: float) -> None:
        """Send `task`'s next hop where its trainer's wiring says; wait if no replica is there."""
        pool = self._trainers[task.trainer][self._hop_stage[task.hop]]
        try:
            name = pool.choose(self._samples)
        except NoReplicaError:
            self._push(t + self.config.retry_s, _RETRY, task)
            return
        pool.started(name, self._samples)
        peer = self._peers[name]
        task.ready = t + delay + peer.latency
        if peer.busy is None:
            self._compute(peer, task, task.ready)
        else:
            peer.queue.append(task)

    def _compute(self, peer: SimPeer, task: SimTask, t: float) -> None:
        peer.busy, task.started = task, t
        seconds = self._hop_work[task.hop] * self._samples / peer.speeds[peer.at]
        self._push(t + seconds, _DONE, peer, peer.epoch)

    def _done(self, peer: SimPeer, t: float) -> None:
        task, at = peer.busy, peer.at
        assert task is not None
        self.meter.credit(at, peer.speeds[at], task.started, t)
        # The wiring's samples/s is per whole stage visit: scale this hop's time to one.
        seconds = (t - task.started + 2.0 * peer.latency) / self._hop_work[task.hop]
        self._trainers[task.trainer][at].finished(peer.name, self._samples, seconds)
        peer.busy = None
        if peer.queue:
            nxt = peer.queue.popleft()
            self._compute(peer, nxt, max(t, nxt.ready))
        elif peer.state == PeerState.DRAINING:
            self._download(peer, t)
        task.hop += 1
        if task.hop == len(self._hop_stage):
            self.meter.completed += self._samples
            task.hop = 0
        self._route(task, t, peer.latency)

    # -- membership -------------------------------------------------------------------------------

    def _start_peers(self) -> None:
        """The initial peers serve where `place` puts them, but for `skew` of stage 0's."""
        config = self.config
        peers = [self._new_peer() for _ in range(config.peers)]
        assignment = self.registry.place_all()
        if config.skew > 0.0 and config.stages > 1:
            first = sorted(p for p, k in assignment.items() if k == 0)
            for i, name in enumerate(first[: min(len(first) - 1, round(config.skew * len(first)))]):
                assignment[name] = 1 + i % (config.stages - 1)
        for peer in peers:
            self.registry.assign(peer.name, assignment[peer.name])
            peer.stage = assignment[peer.name]
            self._ready(peer, 0.0)

    def _new_peer(self) -> SimPeer:
        self._named += 1
        name = f"peer-{self._named:05d}"
        peer, lifetime = new_peer(self._churn, name, self.config, self._affinity)
        self._peers[name] = peer
        domains = None
        if self.config.hosts:  # from dice of its own: the other draws stay as they were
            dice = random.Random(f"{SEED_PREFIX}/{self.config.seed}/{name}/host")
            host = dice.randrange(self.config.hosts)
            domains = Domains(f"host-{host}", f"router-{host // 2}")
        self.registry.add(name, peer.speeds, domains)
        if math.isfinite(lifetime):
            self._push(self.clock.t + lifetime, _DEPART, peer)
        return peer

    def _join(self, t: float) -> None:
        self._push(t + self._churn.expovariate(self.config.joins_per_hour / 3600.0), _JOIN, None)
        peer = self._new_peer()
        peer.stage = self.registry.join_stage(peer.name)
        self.registry.assign(peer.name, peer.stage)
        self._fetch(peer, t)
        self.meter.count("joins")

    def _fetch(self, peer: SimPeer, t: float) -> None:
        """Start downloading the state of `peer.stage` (a new epoch voids an older download)."""
        peer.state, peer.epoch = PeerState.DOWNLOADING, peer.epoch + 1
        seconds = self.config.download_s * self.config.sizes[peer.stage]
        self._push(t + seconds, _READY, peer, peer.epoch)

    def _ready(self, peer: SimPeer, t: float) -> None:
        """`peer` has its stage's state: it serves, and the trainers learn of it."""
        peer.state, peer.at = PeerState.SERVING, peer.stage
        self.meter.serve(peer.at, peer.speeds[peer.at], t)
        if peer.fresh:
            peer.fresh = False
            self.registry.count(peer.name)
            self.meter.optimum.set(t, self.registry.optimum_now())
        for wiring in self._trainers:
            wiring.add(peer.name, peer.at, peer.speeds[peer.at])

    def _download(self, peer: SimPeer, t: float) -> None:
        """A draining peer has finished its queue: it leaves its pool and fetches its new stage."""
        self.meter.serve(peer.at, -peer.speeds[peer.at], t)
        peer.at = -1
        for wiring in self._trainers:
            wiring.remove(peer.name)
        self._fetch(peer, t)

    def _depart(self, peer: SimPeer, t: float) -> None:
        """A crash: the peer's running and queued hops fail at their trainers and go elsewhere."""
        tasks = ([peer.busy] if peer.busy is not None else []) + list(peer.queue)
        peer.busy = None
        peer.queue.clear()
        peer.state, peer.epoch = PeerState.GONE, peer.epoch + 1
        if peer.at >= 0:
            self.meter.serve(peer.at, -peer.speeds[peer.at], t)
            for task in tasks:
                self._trainers[task.trainer][peer.at].failed(peer.name, self._samples)
        for wiring in self._trainers:
            wiring.remove(peer.name)
        del self._peers[peer.name]
        self.registry.remove(peer.name)
        self.meter.optimum.set(t, self.registry.optimum_now())
        self.meter.count("departures")
        self.meter.count("failed_hops", len(tasks))
        for task in tasks:  # the trainer hears of the failure one latency later
            self._route(task, t, peer.latency)
        if self.config.policy == "swarm":
            for move in self.registry.refill(t):  # its stage lost its last replica: at once
                self._move(move, t)

    # -- the scheduler's periodic work ------------------------------------------------------------

    def _rebalance(self, t: float) -> None:
        config = self.config.rebalance_config
        self._push(t + config.period_s, _REBALANCE, None)
        move = self.registry.plan(t)
        if move is not None:
            self._move(move, t)

    def _move(self, move: Move, t: float) -> None:
        """Carry out a move the registry has decided (and assigned)."""
        self.meter.count("moves")
        peer = self._peers[move.peer]
        peer.stage = move.dst
        if peer.state == PeerState.SERVING:
            peer.state = PeerState.DRAINING
            for wiring in self._trainers:
                wiring.set_draining(peer.name, True)
            if peer.busy is None:
                self._download(peer, t)
        elif peer.state == PeerState.DOWNLOADING:
            self._fetch(peer, t)  # still joining: fetch the new stage instead
        # DRAINING: it fetches its (new) stage once its queue is empty.

    def _report_loads(self, t: float) -> None:
        """Each computing replica tells every trainer its queue, as it would on MQTT."""
        self._push(t + self.config.load_report_s, _LOAD, None)
        for peer in self._peers.values():
            if peer.at >= 0:
                queued = (len(peer.queue) + (peer.busy is not None)) * self._samples
                for wiring in self._trainers:
                    wiring.report_load(peer.name, queued, None)

    def _sample(self, t: float) -> None:
        """Evaluate the optimum for the peers present, less those still joining (`report`)."""
        every = self.config.optimum_every_s or self.config.window_s
        self._push(t + every, _SAMPLE, None)
        self.meter.optimum.set(t, self.registry.evaluate_optimum())
