"""The coordinator's live-step window: which steps are open, from their opening until their
commit is applied, each with its ledger and its commit; chosen once from the job's rule
(`window_of`).

Under a rule with rounds (`LiveSteps`), one is live: step t+1 opens once step t is applied
everywhere (and its round, if it ends one, has ended). The plain synchronous rule (`SyncSteps`)
opens step t+1 once step t is decided: every PREPARE answered, the APPLYs sent. Step t stays
live until its APPLYs answered, so nothing admits, drops or rolls back a replica as if the
step were over; a replica that gets step t+1's work before its APPLY waits for it
(`stage_server.replica.pending_apply`), so each step still computes on the parameters after
the one before, exactly as before, and the APPLY's answer, the step's bookkeeping, the lease
and the first push run beside the APPLYs rather than after them (issue 69). With
`training.delayed_update` (`DelayedSteps`) step t+1 opens as soon as step t has nothing left to
lease, once step t-1 is applied (its microbatches compute on the parameters before step t's
update, which the replicas keep), so two are live at once: step t, draining and then
committing, with the replays a failed round needs (leased first), and step t+1. Neither the
pipeline's drain nor the averaging leaves it idle. In both, step t+1's commit waits for step
t's APPLY, so the updates are applied in order, each once.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from scheduler.coordinator.ledger import StepLedger
from swarm.clock import Clock
from swarm.job.config import JobConfig
from swarm.job.rule import Rule, RuleKind
from swarm.policy.backoff import Backoff
from swarm.proto import stage_pb2 as pb

__all__ = ["SPOKEN_STEPS", "Commit", "DelayedSteps", "Live", "LiveSteps", "SyncSteps", "window_of"]

# Steps after their last live moment whose lessees still speak for their microbatches: an
# audit's own report comes at most one step after its step's commit; a rollback's reopened steps
# are a few more.
SPOKEN_STEPS = 8


def _retry_backoff() -> Backoff:
    # Pauses between commit attempts that wait on no replay (a member without gradients left,
    # a round another member aborted): short, since trainers idle meanwhile.
    return Backoff(first_s=0.1, cap_s=2.0)


@dataclass
class Commit:
    attempt: int = 0  # names the round: a retry never reuses a failed round's id
    task: asyncio.Task[bool] | None = None  # set from the first attempt until the next step opens
    applied: bool = False  # the step is committed: late reports and releases for it are moot
    failed_rounds: int = 0  # PREPARE rounds of this step that failed: `max_commit_rounds` ends it
    backoff: Backoff = field(default_factory=_retry_backoff)


@dataclass
class Live:
    """A step from its opening until its commit is applied: its ledger and its commit."""

    ledger: StepLedger
    commit: Commit = field(default_factory=Commit)
    started: float = field(default_factory=time.perf_counter)


class LiveSteps:
    """The live steps, oldest first: one at a time, but for `DelayedSteps`."""

    def __init__(self, job: JobConfig, steps: int, clock: Clock) -> None:
        """`steps`: the job's; after the last, only its final evaluation opens."""
        self.job, self.steps, self.clock = job, steps, clock
        self._live: list[Live] = []
        # Of the steps live last, newest last: who spoke for each microbatch there speaks for it
        # after (an audit's own report comes at most a step after its step's commit,
        # `client.audit.late_audits`); anyone else's word on it is not taken. Only that is
        # kept of their ledgers (`StepLedger.spoken`).
        self._gone: collections.deque[tuple[int, dict[int, frozenset[str]]]] = collections.deque(
            maxlen=SPOKEN_STEPS
        )

    def __iter__(self) -> Iterator[Live]:
        return iter(list(self._live))

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, live: Live) -> bool:
        return live in self._live

    @property
    def oldest(self) -> Live | None:
        return self._live[0] if self._live else None

    @property
    def newest(self) -> Live | None:
        return self._live[-1] if self._live else None

    def at(self, step: int) -> Live | None:
        return next((live for live in self._live if live.ledger.step == step), None)

    def ledgers(self) -> list[StepLedger]:
        """The ledgers of the live steps not yet applied, oldest first: the oldest one's step
        is the one members are at."""
        return [live.ledger for live in self._live if not live.commit.applied]

    def working(self) -> list[Live]:
        """The live steps whose commit has not started: trainers work on these, oldest first."""
        return [live for live in self._live if not live.commit.task]

    def committing(self) -> bool:
        """A commit is deciding (an applied one only tells the world now)."""
        return any(live.commit.task is not None and not live.commit.applied for live in self._live)

    def commits(self) -> set[asyncio.Task[bool]]:
        """The commit tasks of the live steps (even applied ones telling the world still)."""
        return {live.commit.task for live in self._live if live.commit.task is not None}

    def cancel_commits(self) -> None:
        for live in self._live:
            if live.commit.task:
                live.commit.task.cancel()
                live.commit.task = None

    def open(self, step: int, beside: bool = False) -> StepLedger | None:
        """Open `step`: the only live step, or (`beside`, delayed_update) the next one beside
        the step whose commit is starting. None: the job is done (nothing is left to open)."""
        if not beside:
            for live in self._live:
                old = live.commit.task
                if old is not None and old is not asyncio.current_task():
                    old.cancel()  # a retry of a ledger that is history now would void replicas
                self._gone.append((live.ledger.step, live.ledger.spoken()))
            self._live = []
        t = self.job.training
        evaluates = t.eval_every > 0 and (step % t.eval_every == 0 or step >= self.steps)
        if step >= self.steps and not (evaluates and step == self.steps):
            return None
        m = t.microbatches_per_step
        ledger = StepLedger(
            step,
            m if step < self.steps else 0,  # after the last step: the final evaluation only
            t.stages,
            self.job.runtime.lease_timeout_s,
            self.clock,
            microbatch_size=t.microbatch_size,
            evaluations=range(m, m + t.eval_microbatches) if evaluates else range(0),
        )
        self._live.append(Live(ledger))
        return ledger

    def remove(self, live: Live) -> None:
        self._live.remove(live)
        self._gone.append((live.ledger.step, live.ledger.spoken()))

    def speaks_for(self, trainer: str, step: int, index: int) -> bool | None:
        """Whether `trainer`'s word on microbatch `(step, index)` is taken (`StepLedger.speaks_for`)
        while its step is live or among the last `SPOKEN_STEPS` live; None: a step older than
        those, or none this coordinator opened, whose microbatches nobody speaks for."""
        live = self.at(step)
        if live is not None:
            return live.ledger.speaks_for(trainer, index)
        spoken = next((spoken for at, spoken in reversed(self._gone) if at == step), None)
        return None if spoken is None else trainer in spoken.get(index, frozenset())

    def beside(self, ledger: StepLedger) -> int | None:
        """The step to open beside `ledger`'s as its commit starts, if any."""
        return None

    def early(self) -> int | None:
        """The step to open before the live one completes, if any."""
        return None

    def decided(self, ledger: StepLedger) -> int | None:
        """The step to open once `ledger`'s commit is decided (its APPLYs sent), if any."""
        return None

    def receipts(self, info: pb.StageInfoResponse, step: int) -> dict[int, int] | None:
        """The receipts a replica's `info` holds for `step`, each with the run it names (index
        -> run; 0 where it names none); None where it is elsewhere."""
        if info.step != step:
            return None
        return _with_runs(info.receipts, info.receipt_runs)

    def progress(self) -> str:
        """Where the oldest open step is, in words (for a stall's message): its microbatches
        still without a gradient somewhere, or its commit and how many rounds failed."""
        if not self._live:
            return "no step open"
        live = self._live[0]
        ledger, commit = live.ledger, live.commit
        if commit.task is not None:
            failed = (
                f", {commit.failed_rounds} failed round(s) so far" if commit.failed_rounds else ""
            )
            return f"step {ledger.step} is committing (attempt {commit.attempt + 1}{failed})"
        total = len(ledger.evaluations) + ledger.microbatches
        return (
            f"step {ledger.step} waits for {ledger.remaining} of its {total} microbatches "
            f"({ledger.holding()} trainer(s) hold leases on them)"
        )


class DelayedSteps(LiveSteps):
    """delayed_update's window: two live steps, the next opened beside the one committing."""

    def beside(self, ledger: StepLedger) -> int | None:
        """The next step opens as `ledger`'s commit starts, unless it is open already. The
        final evaluation (after the last step) opens once that step is applied: it is of the
        trained parameters."""
        step = ledger.step + 1
        if ledger.microbatches and step < self.steps and len(self._live) == 1:
            return step
        return None

    def early(self) -> int | None:
        """Step t+1 computes on parameters no later step changes, so it opens once step t has
        no task left to lease (its last ones still in flight) and step t-1 is applied, rather
        than when step t completes: the pipeline never drains between steps."""
        if len(self._live) != 1:
            return None
        live = self._live[0]
        ledger = live.ledger
        if live.commit.applied or not ledger.microbatches or ledger.step + 1 >= self.steps:
            return None  # the final evaluation opens after the last APPLY: of the trained model
        return ledger.step + 1 if ledger.leasable() == 0 else None

    def receipts(self, info: pb.StageInfoResponse, step: int) -> dict[int, int] | None:
        """A replica at the step before `step` (its commit beside) holds `step`'s receipts
        apart."""
        if info.step + 1 == step:
            return _with_runs(info.next_receipts, info.next_receipt_runs)
        return super().receipts(info, step)


class SyncSteps(LiveSteps):
    """The plain synchronous rule's window: the next step opens as the commit is decided."""

    def decided(self, ledger: StepLedger) -> int | None:
        """The next step, unless `ledger`'s is the last one: the final evaluation opens once
        that is applied (it is of the trained parameters, and the job is done after it)."""
        step = ledger.step + 1
        if ledger.microbatches and step < self.steps and len(self._live) == 1:
            return step
        return None


def _with_runs(receipts: Sequence[int], runs: Sequence[int]) -> dict[int, int]:
    """index -> run of each receipt, its run read in the same place of `runs` (0 where the
    replica named none there: an older replica, or a run made as its Info was read)."""
    return {index: runs[k] if k < len(runs) else 0 for k, index in enumerate(receipts)}


def window_of(rule: Rule, job: JobConfig, steps: int, clock: Clock) -> LiveSteps:
    """The live-step window of `job`, whose rule is `rule`, of `steps` steps."""
    if rule.delays:
        return DelayedSteps(job, steps, clock)
    if rule.kind is RuleKind.SYNC:
        return SyncSteps(job, steps, clock)
    return LiveSteps(job, steps, clock)
