"""The step ledger: for the step being trained, which microbatches still need their gradient added
at which stage, who is computing them (leases), and which replica holds each accepted gradient.

Pure bookkeeping with an injected clock: the scheduler keeps one per job, a standalone trainer
keeps its own. One mechanism covers every way a gradient goes missing: a replica that dies, a
round that is aborted, or a replica that accumulated a microbatch twice over (two trainers raced
for one lease) is *lost*, and each microbatch it held becomes needed again at that stage only
(a replay).

Late receipts: a microbatch given back (released, or reported without some of its stages) may
still have landed at a stage, on a replica whose answer came too late for its trainer. Such a
microbatch is *returned*; before it is leased again the coordinator asks the members for their
receipts and the ledger `adopt`s a receipt for a microbatch it still needs at that stage (that
replica becomes its holder), instead of replaying it elsewhere and voiding the replica for
holding one gradient too many.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from scheduler.coordinator.free_tasks import FreeTasks
from swarm.clock import Clock, MonotonicClock
from swarm.errors import InvalidArgument
from swarm.model.routes import Run
from swarm.rpc.lease import Replica, Task

__all__ = ["EVALUATED", "LEASE_LIFE_TIMEOUTS", "Holding", "StepLedger"]

EVALUATED = -1  # what a validation microbatch needs in `_needed`: its loss, not a stage
# A lease is renewed for at most this many lease timeouts from when its trainer took it, then
# runs out: one leased microbatch renewed forever held its step open for good (any token holder
# may lease). Far past any honest microbatch's time through the pipeline.
LEASE_LIFE_TIMEOUTS = 10


@dataclass(frozen=True)
class Holding:
    """A replica that accumulated a microbatch it must not count: its whole step is void."""

    stage: int
    peer: str


@dataclass
class _Lease:
    trainer: str
    expires: float
    taken: float  # when `trainer` took it: its renewals end `LEASE_LIFE_TIMEOUTS` after
    counted: bool = False  # in `_held`: unexpired, on a microbatch still needed


@dataclass
class StepLedger:
    step: int
    microbatches: int
    stages: int
    lease_timeout_s: float = 60.0  # a lease not reported within this is given to another trainer
    clock: Clock = field(default_factory=MonotonicClock)
    # Samples in every microbatch (swarm.model.data has no partial ones); a report of another count
    # is refused, since the step's gradient is divided by the samples reported. None: unchecked.
    microbatch_size: int | None = None
    # Validation microbatches to evaluate at this step (the parameters the step trains from),
    # by their task index: past the training ones, `microbatches_per_step + i` for the i-th.
    evaluations: range = range(0)

    def __post_init__(self) -> None:
        every = frozenset(range(self.stages))
        self._needed: dict[int, set[int]] = {i: set(every) for i in range(self.microbatches)}
        if self.evaluations and self.evaluations.start < self.microbatches:
            raise ValueError(f"evaluations {self.evaluations} overlap the training microbatches")
        self._needed.update({i: {EVALUATED} for i in self.evaluations})
        # How many of `_needed` still need something, kept by `_got` and `_lost` (every change
        # of `_needed` goes through them): `complete` is asked on every report.
        self._open = len(self._needed) if self.stages else 0
        self._holders: dict[tuple[int, int], str] = {}  # (index, stage) -> peer
        # pool.mode = "local": (index, stage) -> the run whose gradient counts there, as
        # (chain, back) (`swarm.model.routes.Run`), for the route record
        self._runs: dict[tuple[int, int], tuple[tuple[str, ...], tuple[tuple[int, str], ...]]] = {}
        # the same, per stage and peer: a commit asks each stage's holdings several times
        self._held_at: list[dict[str, set[int]]] = [{} for _ in range(self.stages)]
        self._leases: dict[int, _Lease] = {}
        # The trainer whose report of each microbatch was taken: its audit's own report comes
        # after (`MicrobatchResult.late`), when it holds the lease no more.
        self._reporters: dict[int, str] = {}
        # The microbatches `lease` may give (`FreeTasks`); `_expiring`: (expiry, index) of
        # every lease taken or renewed, stale entries skipped.
        self._free = FreeTasks(self._needed if self.stages else ())
        self._expiring: list[tuple[float, int]] = []
        # Per trainer holding any, its counted leases (`_Lease.counted`): kept with every
        # change, so a lease call's fair share costs no scan of the step.
        self._held: Counter[str] = Counter()
        self._returned: set[int] = set()  # given back since their receipts were last checked
        # The push-plane run each microbatch was last leased as, where the scheduler signed it
        # (`Task.run`; 0: none drawn): a late receipt is adopted only under the run of the
        # lease given back (`LateReceipts`). An unsigned task's run is its trainer's own.
        self._pushed_as: dict[int, int] = {}
        self._loss: dict[int, float] = {}
        self._samples: dict[int, int] = {}
        self._val_loss: dict[int, tuple[float, int]] = {}  # index -> (loss sum, samples)
        # Something happened this step that may leave a replica holding a receipt the ledger
        # does not know of: a lease that ran out, work given back or reported without a stage,
        # a duplicate, a loss or an adoption. A step without any is clean: its commit needs no
        # look at every replica's receipts before PREPARE (which checks them itself).
        self.suspect = False
        # Per stage, the replicas whose gradients of this step a yardstick refused (the norm
        # bound: `trust.round_checks`): voided, they stay in their pool, and the step's replays
        # are routed to the others (`routes`), so an honest one's microbatches are judged again
        # on another replica rather than on it.
        self._routed_around: dict[int, set[str]] = {}

    # -- trainers -------------------------------------------------------------------------------
    def lease(self, trainer: str, count: int, exclude: Collection[int] = ()) -> list[Task]:
        """Up to `count` tasks for `trainer`: microbatches that still need a stage and are not
        leased to anyone else (or whose lease expired), nor in `exclude`."""
        now, tasks = self._expire(), list[Task]()
        if count <= 0:
            return tasks
        for index in self._free.lowest(count, exclude):
            self._hold(index, _Lease(trainer, now + self.lease_timeout_s, now))
            self._returned.discard(index)
            if index in self.evaluations:
                tasks.append(Task(self.step, index, frozenset(), evaluate=True))
            else:
                tasks.append(Task(self.step, index, frozenset(self._needed[index])))
        return tasks

    def leasable(self, exclude: Collection[int] = ()) -> int:
        """How many tasks `lease` could give now."""
        self._expire()
        return len(self._free) - sum(1 for index in set(exclude) if index in self._free)

    def _expire(self) -> float:
        """Return to `_free` what a lease that ran out held; returns now."""
        now = self.clock.now()
        while self._expiring and self._expiring[0][0] <= now:
            expires, index = heapq.heappop(self._expiring)
            held = self._leases.get(index)
            if held is not None and held.expires == expires:
                self.suspect = self.suspect or held.counted  # its trainer went silent mid-work
                self._count(held, False)
                if self._needed[index]:
                    self._free.add(index)
        return now

    def _count(self, lease: _Lease, counted: bool) -> None:
        if lease.counted == counted:
            return
        lease.counted = counted
        self._held[lease.trainer] += 1 if counted else -1
        if not self._held[lease.trainer]:
            del self._held[lease.trainer]

    def _hold(self, index: int, lease: _Lease) -> None:
        old = self._leases.get(index)
        if old is not None:
            self._count(old, False)
        self._leases[index] = lease
        self._count(lease, bool(self._needed[index]))
        self._free.discard(index)
        heapq.heappush(self._expiring, (lease.expires, index))

    def _unhold(self, index: int) -> None:
        self._count(self._leases.pop(index), False)
        if self._needed[index]:
            self._free.add(index)

    def held_by(self, trainer: str) -> int:
        """`trainer`'s unexpired leases on microbatches still needed (as of the last lease or
        `leasable` call, which expire what ran out)."""
        return self._held[trainer]

    def holding(self) -> int:
        """How many trainers hold such a lease."""
        return len(self._held)

    def renew(self, trainer: str, indices: Iterable[int]) -> list[int]:
        """`trainer` is still working on these: their leases run `lease_timeout_s` from now,
        but never past `LEASE_LIFE_TIMEOUTS` of them from when it took each. A lease that
        another trainer holds now is not taken back; one that expired but went to nobody is
        `trainer`'s again. Returns the indices renewed."""
        now, renewed = self.clock.now(), []
        life = LEASE_LIFE_TIMEOUTS * self.lease_timeout_s
        for index in indices:
            held = self._leases.get(index)
            if held is None or held.trainer != trainer or not self._needed.get(index):
                continue  # released, reported, or leased to another: no longer this trainer's
            expires = min(now + self.lease_timeout_s, held.taken + life)
            if expires <= now:
                continue  # its life is over: it runs out, and goes to another
            self._hold(index, _Lease(trainer, expires, held.taken))
            renewed.append(index)
        return renewed

    def speaks_for(self, trainer: str, index: int) -> bool:
        """Whether `trainer`'s word on microbatch `index` is taken: it holds its lease (or
        held it last, the lease run out and given to no one since: a straggler), or its report
        of it was taken (its audit's report follows)."""
        lease = self._leases.get(index)
        held = lease is not None and lease.trainer == trainer
        return held or self._reporters.get(index) == trainer

    def spoken(self) -> dict[int, frozenset[str]]:
        """Each microbatch's trainers whose word on it `speaks_for` takes (its lease's holder,
        its taken report's trainer): all a report of this step needs once it is no longer live
        (`scheduler.coordinator.live_steps`), without the rest of the ledger."""
        held = {i: {lease.trainer} for i, lease in self._leases.items()}
        for i, trainer in self._reporters.items():
            held.setdefault(i, set()).add(trainer)
        return {i: frozenset(trainers) for i, trainers in held.items()}

    def recheck(self, index: int) -> None:
        """Microbatch `index` was reported by a trainer whose word is not taken (`speaks_for`):
        a straggler whose lease went to another, a trainer of before a scheduler restart, or
        anyone. Where it is still needed, the members' receipts of it are looked at before it is
        leased again (what landed is adopted, `adopt`), as for work given back."""
        if self._needed.get(index):
            self._returned.add(index)
        self.suspect = True

    def returned(self) -> list[int]:
        """Microbatches given back (released, reported without some of their stages) whose
        receipts have not been checked since: a Backward that timed out at its trainer may have
        landed on a replica all the same. (An expired lease's microbatch goes out at once: with
        renewals, its trainer is gone, and a straggler's receipt there voids its replica.)"""
        now = self.clock.now()
        return sorted(
            index
            for index in self._returned
            if self._needed[index]
            and not ((held := self._leases.get(index)) and held.expires > now)
        )

    def pushed_as(self, tasks: Iterable[Task]) -> None:
        """`tasks`, just leased, are pushed as their runs where their tickets name them."""
        self._pushed_as.update((t.index, t.run) for t in tasks if t.tickets and not t.evaluate)

    def run_of(self, index: int) -> int | None:
        """The run microbatch `index` was last leased as (None: unknown, its trainer's own)."""
        return self._pushed_as.get(index)

    def checked(self, indices: Iterable[int]) -> None:
        """The members' receipts of these were looked at: they may be leased again."""
        self._returned.difference_update(indices)

    def adopt(
        self, stage: int, peer: str, receipts: Iterable[int], among: Collection[int], samples: int
    ) -> list[int]:
        """`peer` holds receipts at `stage` for `receipts`: each one of `among` that the ledger
        still needs there, with no live lease, becomes `peer`'s holding (its gradient is the one
        a replay would add there, so accepting it is exact). Returns the indices adopted."""
        adopted = self.unclaimed(stage, receipts, among)
        for index in adopted:
            self._set_holder(index, stage, peer)
            self._got(index, stage)
            self._samples.setdefault(index, samples)
        self.suspect = self.suspect or bool(adopted)
        return adopted

    def unclaimed(self, stage: int, receipts: Iterable[int], among: Collection[int]) -> list[int]:
        """Which of a replica's `receipts` at `stage` are of microbatches of `among` that the
        ledger still needs there, with no live lease: what `adopt` would take."""
        now = self.clock.now()
        return [
            index
            for index in receipts
            if index in among
            and stage in self._needed.get(index, ())
            and not ((held := self._leases.get(index)) is not None and held.expires > now)
        ]

    def report(
        self,
        trainer: str,
        step: int,
        index: int,
        holders: Mapping[int, str],
        loss_sum: float | None,
        samples: int,
        chain: tuple[str, ...] = (),
        back: tuple[tuple[int, str], ...] = (),
    ) -> list[Holding]:
        """Record that `holders[stage]` accumulated microbatch `index` at `stage`. Returns the
        replicas that now hold a gradient that must not count (someone else's was accepted first).
        Reports of another step are ignored, and one by a trainer whose word on the microbatch is
        not taken (`speaks_for`) only has its receipts looked at (`recheck`). A sample count
        other than `microbatch_size` is refused (InvalidArgument) before anything is recorded."""
        if self.microbatch_size is not None and samples != self.microbatch_size:
            raise InvalidArgument(
                f"microbatch ({step}, {index}) reported {samples} samples; every microbatch has "
                f"training.microbatch_size = {self.microbatch_size}"
            )
        if step != self.step or index not in self._needed:
            return []
        if not self.speaks_for(trainer, index):
            self.recheck(index)
            return []
        self._reporters[index] = trainer
        if index in self.evaluations:
            if loss_sum is not None and index not in self._val_loss:
                self._val_loss[index] = (loss_sum, samples)
                self._got(index, EVALUATED)
            lease = self._leases.get(index)
            if lease and lease.trainer == trainer:
                self._unhold(index)
            return []
        extras, accepted = [], set()
        for stage, peer in holders.items():
            current = self._holders.get((index, stage))
            if stage in self._needed[index]:
                self._set_holder(index, stage, peer)
                self._got(index, stage)
                accepted.add(stage)
                if chain:
                    self._runs[(index, stage)] = (chain, back)
            elif current is not None and current != peer:
                extras.append(Holding(stage, peer))
        if loss_sum is not None:
            if self.stages - 1 in accepted:  # the loss of the run whose gradient counts there
                self._loss[index] = loss_sum
            else:
                self._loss.setdefault(index, loss_sum)
        self._samples.setdefault(index, samples)
        lease = self._leases.get(index)
        if lease and lease.trainer == trainer:
            self._unhold(index)
            if self._needed[index]:  # stages left out (unsure where they landed): given back
                self._returned.add(index)
                self.suspect = True
        else:
            self.suspect = True  # a straggler: another trainer may have run it too
        self.suspect = self.suspect or bool(extras)
        return extras

    def release(self, trainer: str, indices: Iterable[int] | None = None) -> None:
        """`trainer` gives up these leases (all of them by default): they can go to others."""
        chosen = None if indices is None else set(indices)
        for index, lease in list(self._leases.items()):
            if lease.trainer == trainer and (chosen is None or index in chosen):
                self._unhold(index)
                self._returned.add(index)
                self.suspect = True

    # -- replicas -------------------------------------------------------------------------------
    def lose(self, peer: str, stage: int | None = None) -> list[int]:
        """`peer`'s gradients (at `stage`, or every stage) are gone: each microbatch it held is
        needed again there. Returns those microbatch indices."""
        lost = []
        for s in range(self.stages) if stage is None else [stage]:
            for index in sorted(self._held_at[s].pop(peer, ())):
                del self._holders[(index, s)]
                self._runs.pop((index, s), None)
                self._lost(index, s)
                lost.append(index)
        # Replays of a lost gradient go out at once: no late receipt of theirs is worth waiting
        # for, and the lost replica's own receipts (a void not yet landed) must not be adopted.
        self._returned.difference_update(lost)
        self.suspect = self.suspect or bool(lost)
        return sorted(set(lost))

    def unland(self, stage: int, peer: str, indices: Iterable[int]) -> set[str]:
        """`peer` holds no gradient of `indices` at `stage`, though a trainer reported it
        does: each is needed there again (what else `peer` holds stays). Returns the trainers
        whose reports said so."""
        held, said = self._held_at[stage].get(peer, set()), set[str]()
        for index in sorted(set(indices) & held):
            held.discard(index)
            del self._holders[(index, stage)]
            self._runs.pop((index, stage), None)
            self._lost(index, stage)
            if (trainer := self._reporters.pop(index, None)) is not None:
                said.add(trainer)
        self.suspect = True
        return said

    def route_around(self, stage: int, peer: str) -> None:
        """This step's replays at `stage` go to its other replicas, not to `peer`."""
        self._routed_around.setdefault(stage, set()).add(peer)

    def routed_around(self, stage: int, peer: str) -> bool:
        return peer in self._routed_around.get(stage, ())

    def routes(self, members: list[list[Replica]]) -> list[list[Replica]]:
        """`members` as this step's tasks may be routed: without those routed around, unless
        that would leave their stage none."""
        out = []
        for stage, replicas in enumerate(members):
            around = self._routed_around.get(stage, set())
            kept = [r for r in replicas if r.peer not in around]
            out.append(kept or replicas)
        return out

    def holdings(self, stage: int) -> dict[str, list[int]]:
        """Per replica of `stage` (in name order), the microbatches whose gradient it holds."""
        held = self._held_at[stage]
        return {peer: sorted(held[peer]) for peer in sorted(held) if held[peer]}

    def samples_held(self, stage: int, peer: str) -> int:
        """The samples of the microbatches whose gradient `peer` holds at `stage`."""
        return sum(self._samples.get(index, 0) for index in self._held_at[stage].get(peer, ()))

    def runs(self) -> list[Run]:
        """pool.mode = "local": the runs whose gradients count, by microbatch, each with the
        stages it counts at (a gradient adopted from a late receipt names no run)."""
        stages: dict[tuple[int, tuple[str, ...], tuple[tuple[int, str], ...]], list[int]] = {}
        for (index, stage), (chain, back) in sorted(self._runs.items()):
            stages.setdefault((index, chain, back), []).append(stage)
        return [Run(i, tuple(ks), chain, back) for (i, chain, back), ks in stages.items()]

    def _set_holder(self, index: int, stage: int, peer: str) -> None:
        old = self._holders.get((index, stage))
        if old is not None:
            self._held_at[stage][old].discard(index)
        self._holders[(index, stage)] = peer
        self._held_at[stage].setdefault(peer, set()).add(index)

    def holders(self) -> set[str]:
        return set(self._holders.values())

    def _got(self, index: int, stage: int) -> None:
        stages = self._needed[index]
        if stage in stages:
            stages.discard(stage)
            if not stages:
                self._open -= 1
                self._free.discard(index)
                held = self._leases.get(index)
                if held is not None:
                    self._count(held, False)

    def _lost(self, index: int, stage: int) -> None:
        stages = self._needed[index]
        if stage not in stages:
            if not stages:
                self._open += 1
                held = self._leases.get(index)
                if held is None or held.expires <= self.clock.now():
                    self._free.add(index)
                else:
                    self._count(held, True)
            stages.add(stage)

    # -- the step -------------------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        return self._open == 0

    @property
    def remaining(self) -> int:
        """Microbatches that still need a gradient somewhere."""
        return self._open

    def samples(self) -> int:
        return sum(self._samples.values())

    def val_loss(self) -> float | None:
        """The validation loss, as `loss`, summed in index order (as `swarm local` sums it); None
        when this step evaluates nothing, NaN until every validation microbatch reported."""
        if not self.evaluations:
            return None
        if len(self._val_loss) < len(self.evaluations):
            return math.nan
        losses = [self._val_loss[i] for i in self.evaluations]
        return sum(loss for loss, _ in losses) / sum(n for _, n in losses)

    def loss(self) -> float:
        """Mean over the step's samples of each sample's mean token loss (over the microbatches
        whose loss is known: one whose last stage was adopted from a late receipt has none)."""
        total = sum(self._samples.get(index, 0) for index in self._loss)
        return sum(self._loss.values()) / total if total else float("nan")
