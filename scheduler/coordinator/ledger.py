"""The step ledger: for the step being trained, which microbatches still need their gradient added
at which stage, who is computing them (leases), and which replica holds each accepted gradient.

Pure bookkeeping with an injected clock: the scheduler keeps one per job, a standalone trainer
keeps its own. One mechanism covers every way a gradient goes missing: a replica that dies, a
round that is aborted, or a replica that accumulated a microbatch twice over (two trainers raced
for one lease) is *lost*, and each microbatch it held becomes needed again at that stage only
(a replay).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from swarm.clock import Clock, MonotonicClock
from swarm.lease import Task

__all__ = ["Holding", "StepLedger"]


@dataclass(frozen=True)
class Holding:
    """A replica that accumulated a microbatch it must not count: its whole step is void."""

    stage: int
    peer: str


@dataclass
class _Lease:
    trainer: str
    expires: float


@dataclass
class StepLedger:
    step: int
    microbatches: int
    stages: int
    lease_timeout_s: float = 60.0  # a lease not reported within this is given to another trainer
    clock: Clock = field(default_factory=MonotonicClock)

    def __post_init__(self) -> None:
        every = frozenset(range(self.stages))
        self._needed: dict[int, set[int]] = {i: set(every) for i in range(self.microbatches)}
        self._holders: dict[tuple[int, int], str] = {}  # (index, stage) -> peer
        self._leases: dict[int, _Lease] = {}
        self._loss: dict[int, float] = {}
        self._samples: dict[int, int] = {}

    # -- trainers -------------------------------------------------------------------------------
    def lease(self, trainer: str, count: int) -> list[Task]:
        """Up to `count` tasks for `trainer`: microbatches that still need a stage and are not
        leased to anyone else (or whose lease expired)."""
        now, tasks = self.clock.now(), list[Task]()
        for index in sorted(self._needed):
            if len(tasks) >= count:
                break
            stages = self._needed[index]
            held = self._leases.get(index)
            if not stages or (held and held.expires > now):  # a trainer's own included
                continue
            self._leases[index] = _Lease(trainer, now + self.lease_timeout_s)
            tasks.append(Task(self.step, index, frozenset(stages)))
        return tasks

    def report(
        self,
        trainer: str,
        step: int,
        index: int,
        holders: Mapping[int, str],
        loss_sum: float | None,
        samples: int,
    ) -> list[Holding]:
        """Record that `holders[stage]` accumulated microbatch `index` at `stage`. Returns the
        replicas that now hold a gradient that must not count (someone else's was accepted first).
        Reports of another step are ignored."""
        if step != self.step or index not in self._needed:
            return []
        extras = []
        for stage, peer in holders.items():
            current = self._holders.get((index, stage))
            if stage in self._needed[index]:
                self._holders[(index, stage)] = peer
                self._needed[index].discard(stage)
            elif current is not None and current != peer:
                extras.append(Holding(stage, peer))
        if loss_sum is not None:
            self._loss.setdefault(index, loss_sum)
        self._samples.setdefault(index, samples)
        lease = self._leases.get(index)
        if lease and lease.trainer == trainer:
            del self._leases[index]
        return extras

    def release(self, trainer: str, indices: Iterable[int] | None = None) -> None:
        """`trainer` gives up these leases (all of them by default): they can go to others."""
        for index, lease in list(self._leases.items()):
            if lease.trainer == trainer and (indices is None or index in set(indices)):
                del self._leases[index]

    # -- replicas -------------------------------------------------------------------------------
    def lose(self, peer: str, stage: int | None = None) -> list[int]:
        """`peer`'s gradients (at `stage`, or every stage) are gone: each microbatch it held is
        needed again there. Returns those microbatch indices."""
        lost = []
        for (index, s), holder in list(self._holders.items()):
            if holder == peer and (stage is None or s == stage):
                del self._holders[(index, s)]
                self._needed[index].add(s)
                lost.append(index)
        return sorted(set(lost))

    def holdings(self, stage: int) -> dict[str, list[int]]:
        """Per replica of `stage`, the microbatches whose gradient it holds."""
        result: dict[str, list[int]] = {}
        for (index, s), peer in sorted(self._holders.items()):
            if s == stage:
                result.setdefault(peer, []).append(index)
        return result

    def holders(self) -> set[str]:
        return set(self._holders.values())

    # -- the step -------------------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        return all(not stages for stages in self._needed.values())

    @property
    def remaining(self) -> int:
        """Microbatches that still need a gradient somewhere."""
        return sum(1 for stages in self._needed.values() if stages)

    def samples(self) -> int:
        return sum(self._samples.values())

    def loss(self) -> float:
        """Mean over the step's samples of each sample's mean token loss."""
        total = self.samples()
        return sum(self._loss.values()) / total if total else float("nan")
