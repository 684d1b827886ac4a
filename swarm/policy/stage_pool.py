"""One stage's replicas as one trainer sees them, and the wiring's choice among them (`StagePool`);
`swarm.policy.wiring` states the rule and routes a job's stages to their pools.

Cost. A choice is O(log n) amortised in the pool size n. Every eligible replica has exactly one
*live* entry in a binary heap ordered by expected finish time; any change to a replica (a start, a
finish, a load report, a backoff, draining) stamps it with a fresh sequence number and pushes a new
entry, which makes the old one stale without searching for it (lazy invalidation). A stale entry
is discarded when it reaches the top, so each push pays for at most one later pop. Replicas in
backoff (the wiring's pause after a failed call; not an audit's ban) have no live entry at all:
they wait in a second heap ordered by the backoff's end and are pushed back when the clock passes
it, one pop and one push per backoff, charged to the failure that caused it.
A replica left idle gets one entry in a third heap, the time it is due for a probe (below), one
push and one pop charged to the finish that left it idle.
A pool with 9,000 of 10,000 replicas in backoff therefore costs a choice no more than a pool of
1,000 (but for the log factor). When stale entries outnumber live ones the heap is rebuilt (O(n)
after at least n pushes, so O(1) amortised), which bounds memory. Ties are drawn uniformly from the
entries equal to the top, which form a subtree at the root; reading at most _TIE_SCAN of them
keeps that O(1). `choose` itself pushes nothing. `heap_operations` counts all of this work for
the simulator's cost accounting and for the complexity test.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from swarm.clock import Clock
from swarm.errors import SwarmError
from swarm.policy.wiring_config import WiringConfig

__all__ = ["NoReplicaError", "StagePool"]


class NoReplicaError(SwarmError):
    """Every replica of the stage is in backoff, draining or gone: the caller must wait or roll
    back."""


@dataclass(slots=True)
class _Replica:
    throughput: float  # samples/s: announced or reported until measured, then an EMA
    measured: bool = False  # whether `throughput` comes from this trainer's own measurements
    own: float = 0.0  # samples this trainer started there and has not seen finish or fail
    others: float = 0.0  # other trainers' samples queued there, from the last load report
    draining: bool = False
    failures: int = 0  # consecutive failures; a success resets it
    backoff_until: float = -math.inf
    backoff_seq: int = 0  # identifies the live entry in the backoff heap
    entry_key: float | None = None  # while new (never started) or probed: 0, ahead of all
    probe_seq: int = 0  # identifies the live entry in the probe heap
    seq: int = 0  # identifies the live entry in the choice heap
    in_heap: bool = False  # whether a live entry exists in the choice heap


# A heap entry: (expected finish time, random tie-break priority, sequence number, peer). The
# sequence number is unique, so comparisons never reach the peer id.
_Entry = tuple[float, float, int, str]

# Rebuild the heap when it holds more than this many entries per live one (plus a small slack).
_COMPACT_RATIO = 2
_COMPACT_SLACK = 32
# Most heap entries read to find the replicas tied for the smallest expected finish time.
_TIE_SCAN = 16


class StagePool:
    """The replicas of one stage as one trainer sees them, and its choice among them."""

    def __init__(
        self,
        *,
        clock: Clock,
        rng: random.Random,
        config: WiringConfig | None = None,
        task_samples: float = 1.0,
    ) -> None:
        """`task_samples` is the task size the heap is ordered for (the microbatch size): the
        ordering of `(queued + task) / throughput` depends on the task, so `choose` with another
        size re-keys the heap once (O(n)) and keeps that size until the next change."""
        _check_positive("task_samples", task_samples)
        self._clock = clock
        self._rng = rng
        self._config = config or WiringConfig()
        self._task = float(task_samples)
        self._replicas: dict[str, _Replica] = {}
        self._heap: list[_Entry] = []
        self._backoffs: list[tuple[float, int, str]] = []  # (backoff_until, backoff_seq, peer)
        self._probes: list[tuple[float, int, str]] = []  # (due, probe_seq, peer): idle replicas
        self._live = 0  # live entries in self._heap == eligible replicas
        self._seq = 0
        self.heap_operations = 0
        """Work done since creation, in heap entries: pushes, pops, entries read to break a tie,
        and a rebuild's size. Each push or pop is O(log n), everything else O(1)."""

    # -- membership -------------------------------------------------------------------------------

    def add(self, peer: str, throughput: float) -> None:
        """A replica joins with its announced samples/s. Until it is tried it goes ahead of every
        replica tried already (its key is 0), so the next choice tries it even if its
        announcement undersells it. (Entering at the minimum key of the moment is not enough:
        once the others are idle again their keys fall below that minimum, and a replica that
        joined while they were busy got no work for good. Nor is entering at 0 only when that
        minimum is below its own key: replicas that join together tie, and the first one
        measured then left the others none for good.) Adding a known peer only refreshes an
        unmeasured throughput."""
        _check_positive("throughput", throughput)
        known = self._replicas.get(peer)
        if known is not None:
            if not known.measured:
                known.throughput = float(throughput)
                self._refresh(known, peer)
            return
        replica = _Replica(throughput=float(throughput), entry_key=0.0)
        self._replicas[peer] = replica
        self._refresh(replica, peer)

    def remove(self, peer: str) -> bool:
        """Forget a replica (it left or went offline); its heap entries go stale."""
        replica = self._replicas.pop(peer, None)
        if replica is None:
            return False
        self._drop(replica)
        return True

    def set_draining(self, peer: str, draining: bool) -> None:
        """A draining replica finishes what it has but gets no new work."""
        replica = self._replicas.get(peer)
        if replica is not None and replica.draining != draining:
            replica.draining = draining
            self._refresh(replica, peer)

    def report_load(
        self, peer: str, queued_samples: float, seconds_per_sample: float | None
    ) -> bool:
        """Merge a load report the replica published. Returns False if it was ignored (unknown
        peer, or values no honest peer sends: reports are untrusted input).

        The reported queue counts this trainer's own work too, so only the excess over what this
        trainer has in flight at the time of the report is kept, as other trainers' work:
        queued = own_now + max(0, reported - own_at_report). Own work is never counted twice, and
        it stays exact between reports because `started`/`finished` update it directly. When the
        report is smaller than our own in-flight work (some of ours is still on the network), the
        excess is zero. The reported seconds/sample seeds the throughput until this trainer has
        measured one itself (its own measurement includes the network, which is what matters)."""
        replica = self._replicas.get(peer)
        if replica is None or not (math.isfinite(queued_samples) and queued_samples >= 0.0):
            return False
        if seconds_per_sample is not None:
            if not (math.isfinite(seconds_per_sample) and seconds_per_sample > 0.0):
                return False
            if not replica.measured:
                replica.throughput = 1.0 / seconds_per_sample
        replica.others = max(0.0, queued_samples - replica.own)
        self._refresh(replica, peer)
        return True

    # -- the choice and its outcome ---------------------------------------------------------------

    def choose(self, task_samples: float) -> str:
        """The replica with the smallest expected finish time for a task of `task_samples`, ties
        drawn uniformly at random. Raises NoReplicaError when none is eligible. Choosing does not
        change the pool: call `started` once the task is sent."""
        if task_samples != self._task:
            _check_positive("task_samples", task_samples)
            self._task = float(task_samples)
            self._rebuild()
        self._expire_backoffs()
        top = self._top()
        if top is None:
            raise NoReplicaError(
                f"no eligible replica among {len(self._replicas)}: all in backoff, draining or gone"
            )
        if self._probes and self._probes[0][0] <= self._clock.now():
            self._expire_probes()
            top = self._top()
            assert top is not None  # a probe only moves an eligible replica ahead
        return self._pick_tied(top)

    def started(self, peer: str, samples: float) -> None:
        """This trainer sent `samples` to `peer`. Unknown peers (removed meanwhile) are ignored."""
        _check_non_negative("samples", samples)
        replica = self._replicas.get(peer)
        if replica is None:
            return
        replica.own += samples
        replica.entry_key = None  # tried: from now on its own figures speak for it
        replica.probe_seq = self._next_seq()  # busy: no probe is due
        self._refresh(replica, peer)

    def finished(self, peer: str, samples: float, seconds: float) -> None:
        """`peer` returned `samples` after `seconds` of service, network included but not the time
        the task waited behind others in the replica's queue (queued work is already in the
        numerator of the expected finish time; counting it here too would punish busy replicas
        twice). A duration of 0 (below clock resolution) carries no rate and leaves the EMA."""
        _check_non_negative("samples", samples)
        _check_non_negative("seconds", seconds)
        replica = self._replicas.get(peer)
        if replica is None:
            return
        replica.own = max(0.0, replica.own - samples)
        replica.failures = 0
        if seconds > 0.0 and samples > 0.0:
            rate = samples / seconds
            if replica.measured:
                alpha = self._config.throughput_ema_alpha
                replica.throughput += alpha * (rate - replica.throughput)
            else:
                # The announced figure leaves out the network; the first measurement is better.
                replica.throughput = rate
                replica.measured = True
        if replica.own == 0.0 and replica.measured:  # idle: due for a probe if left so
            due = self._clock.now() + self._config.probe_after * self._natural_key(replica)
            replica.probe_seq = self._next_seq()
            heapq.heappush(self._probes, (due, replica.probe_seq, peer))
            self.heap_operations += 1
        self._refresh(replica, peer)

    def busy(self, peer: str, samples: float) -> None:
        """`peer` answered that its queue is full (the push plane's busy answer): not a failure,
        so no backoff; its `samples` leave this pool's own count, and it is believed that much more
        loaded until its next load report says otherwise."""
        if peer not in self._replicas:
            return
        self.report_load(peer, self.queued(peer) + samples, None)
        self.finished(peer, samples, 0.0)

    def failed(self, peer: str, samples: float = 0.0) -> float:
        """A call to `peer` failed; its `samples` leave the queue and the replica is in backoff
        for backoff_base_s * backoff_factor**(failures - 1), at most backoff_max_s. Returns the
        new backoff's length in seconds, or 0.0 if the replica was in backoff already: the other
        in-flight calls that fail with it report the same outage and must not stretch the
        backoff. The backoff outlives a late
        success (a reply sent before the crash) but that success resets the failure count."""
        _check_non_negative("samples", samples)
        replica = self._replicas.get(peer)
        if replica is None:
            return 0.0
        replica.own = max(0.0, replica.own - samples)
        now = self._clock.now()
        if replica.backoff_until > now:
            return 0.0
        config = self._config
        replica.failures += 1
        try:
            seconds = min(
                config.backoff_max_s,
                config.backoff_base_s * config.backoff_factor ** (replica.failures - 1),
            )
        except OverflowError:  # a long run of failures: the cap has long been reached
            seconds = config.backoff_max_s
        replica.backoff_until = now + seconds
        replica.backoff_seq = self._next_seq()
        heapq.heappush(self._backoffs, (replica.backoff_until, replica.backoff_seq, peer))
        self.heap_operations += 1
        self._drop(replica)
        return seconds

    # -- views ------------------------------------------------------------------------------------

    def eligible(self) -> list[str]:
        """Peers that `choose` may return now, sorted (O(n): for metrics and tests)."""
        self._expire_backoffs()
        return sorted(p for p, r in self._replicas.items() if self._is_eligible(r))

    def expected_finish(self, peer: str, task_samples: float | None = None) -> float:
        """Seconds until a task of `task_samples` (default: the ordering size) sent now would
        finish at `peer`, by the model `(queued + task) / throughput`."""
        replica = self._replicas[peer]
        task = self._task if task_samples is None else task_samples
        return (replica.own + replica.others + task) / replica.throughput

    def throughput(self, peer: str) -> float:
        return self._replicas[peer].throughput

    def queued(self, peer: str) -> float:
        """Samples queued at `peer` as this trainer believes: its own plus others' last report."""
        replica = self._replicas[peer]
        return replica.own + replica.others

    def backoff_until(self, peer: str) -> float | None:
        """Clock time the peer's backoff ends, or None if it is in none now."""
        until = self._replicas[peer].backoff_until
        return until if until > self._clock.now() else None

    def __contains__(self, peer: object) -> bool:
        return peer in self._replicas

    def __len__(self) -> int:
        return len(self._replicas)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._replicas))

    # -- heap upkeep ------------------------------------------------------------------------------

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _natural_key(self, replica: _Replica) -> float:
        return (replica.own + replica.others + self._task) / replica.throughput

    def _key(self, replica: _Replica) -> float:
        key = self._natural_key(replica)
        if replica.entry_key is not None and replica.entry_key < key:
            return replica.entry_key
        return key

    def _priority(self, replica: _Replica) -> float:
        # Orders tied entries in the heap at random, so that when more than _TIE_SCAN replicas
        # tie, the few `_pick_tied` reads are a random few. A new replica draws from [-1, 0) so
        # it sorts ahead of established replicas at its key.
        return self._rng.random() - (1.0 if replica.entry_key is not None else 0.0)

    def _is_eligible(self, replica: _Replica) -> bool:
        return not replica.draining and replica.backoff_until == -math.inf

    def _refresh(self, replica: _Replica, peer: str) -> None:
        """Re-key the replica after a change: stale its entry and push a live one if eligible."""
        if not self._is_eligible(replica):
            self._drop(replica)
            return
        replica.seq = self._next_seq()
        if not replica.in_heap:
            replica.in_heap = True
            self._live += 1
        heapq.heappush(self._heap, (self._key(replica), self._priority(replica), replica.seq, peer))
        self.heap_operations += 1
        if len(self._heap) > _COMPACT_RATIO * self._live + _COMPACT_SLACK:
            self._rebuild()

    def _drop(self, replica: _Replica) -> None:
        replica.seq = self._next_seq()  # whatever entry it had is stale now
        if replica.in_heap:
            replica.in_heap = False
            self._live -= 1

    def _top(self) -> _Entry | None:
        """The live entry with the smallest key, after discarding stale ones above it."""
        heap = self._heap
        while heap:
            entry = heap[0]
            replica = self._replicas.get(entry[3])
            if replica is not None and replica.seq == entry[2]:
                return entry
            heapq.heappop(heap)
            self.heap_operations += 1
        return None

    def _pick_tied(self, top: _Entry) -> str:
        """A peer drawn uniformly from the live entries tied with `top` (same key, and new or not
        alike: a new replica goes ahead of older ones at its key). Entries equal to the root form
        a subtree at the root, so a breadth-first walk that stops at larger entries finds them
        all, touching at most _TIE_SCAN entries: exact while ties are few (two idle replicas of
        one speed), and still random beyond that, since the entries nearest the root are the
        ones with the smallest random priorities."""
        heap, key, new = self._heap, top[0], top[1] < 0.0
        tied: list[str] = []
        frontier = deque([0])
        touched = 0
        while frontier and touched < _TIE_SCAN:
            index = frontier.popleft()
            entry = heap[index]
            touched += 1
            if entry[0] != key or (entry[1] < 0.0) != new:
                continue
            replica = self._replicas.get(entry[3])
            if replica is not None and replica.seq == entry[2]:
                tied.append(entry[3])
            frontier.extend(child for child in (2 * index + 1, 2 * index + 2) if child < len(heap))
        self.heap_operations += touched
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)

    def _expire_backoffs(self) -> None:
        backoffs = self._backoffs
        if not backoffs:
            return
        now = self._clock.now()
        while backoffs and backoffs[0][0] <= now:
            _, backoff_seq, peer = heapq.heappop(backoffs)
            self.heap_operations += 1
            replica = self._replicas.get(peer)
            if replica is not None and replica.backoff_seq == backoff_seq:
                replica.backoff_until = -math.inf
                self._refresh(replica, peer)

    def _expire_probes(self) -> None:
        """Every replica left idle past its probe time goes ahead of the others (key 0) until it
        is tried, as a new one does; one busy, in backoff or draining meanwhile needs none."""
        probes, now = self._probes, self._clock.now()
        while probes and probes[0][0] <= now:
            _, probe_seq, peer = heapq.heappop(probes)
            self.heap_operations += 1
            replica = self._replicas.get(peer)
            if replica is not None and replica.probe_seq == probe_seq and replica.own == 0.0:
                replica.entry_key = 0.0
                self._refresh(replica, peer)

    def _rebuild(self) -> None:
        """Rebuild the heap from the eligible replicas: drops stale entries, applies a new key."""
        entries: list[_Entry] = []
        for peer, replica in self._replicas.items():
            if replica.in_heap:
                replica.seq = self._next_seq()
                entries.append((self._key(replica), self._priority(replica), replica.seq, peer))
        heapq.heapify(entries)
        self.heap_operations += len(self._heap) + len(entries)
        self._heap = entries


def _check_positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"{name}={value}: must be a positive finite number")


def _check_non_negative(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"{name}={value}: must be a finite number >= 0")
