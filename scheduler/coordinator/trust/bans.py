"""Peers banned from a job (issue 55): a replica that an audit by re-execution caught lying
(`client.audit.audits`: its answer contradicted by two others of its stage) is out of the
job for good, and its influence is replayed away.

- **Banned**: it is no member from then on, whatever the peer registry or the command line says
  (its `standing`'s `members` filters it out of every view the coordinator takes: trainers,
  rounds, rollbacks, checkpoints), and the ban is said in the log and to the job's history
  with the evidence (`on_ban` is given the `Ban`: its peer, its `text`).
  The id is its credential only where the broker binds ids to credentials (a certificate named
  as the id under `--use-identity-as-username`, a Mosquitto password of its own): with the
  shared token alone, TLS or not, a liar can come back under another id, to be audited again.
  Where the book says ids bind certificates (`BanBook.binds_credentials`: the scheduler's
  embedded broker under `--use-identity-as-username`), a ban bars every id the banned one's
  certificate may certify (`swarm.net.peer_names.barred`): an invite's holder banned under
  `gpu1.alice` comes back under no id of `alice`'s (issue 64).
- **Replayed away**: any of its answers may have been wrong, not only the one caught, and every
  microbatch it touched moved every stage's gradient. So the job rolls back to the last
  checkpoint at or before the first step it could have worked on unaudited (`since`): its
  `first_seen` (the first lease given while it was a member, kept in the job's `BanBook` so
  that a restarted scheduler knows it; 0 for those present when a coordinator started mid-job
  and kept nowhere, which it cannot know), but no further back than its doubt window
  (`doubt_window`, issue 64: the depth was the liar's to choose, a peer honest for K steps
  that lied once erased K steps, and after a scheduler restart the whole job). The window is
  the steps within which the audits, at the job's `audit_fraction`, would have caught a peer
  lying in every answer it gave with probability 1 - 1e-6: one step when every answer is
  audited. The checkpoints after its start are deleted, the older kept, and the job trains
  again from there without it: the result is the honest run's, float64-equal to `swarm local`
  (a lie older than the window, by a liar that lies rarely, stays, as one by a liar never
  caught does: docs/decisions.md, "A ban's depth").
- **Seats of one host**: a verdict of two re-executions convicts only where its auditors are
  seats of two hosts or more (`swarm.net.seats`: the host a member is dialled at), issue 64:
  two ids of one token holder, placed in one stage, framed its honest third replica with
  matching wrong re-executions. The ids are free with the shared token; the machines they are
  dialled at are not. Logged, once per accused peer.
- **Stragglers**: a microbatch in flight when the ban came may have gone through the banned
  peer and still be reported, even after the rollback (its step comes again). A result that
  rests on a banned peer's answer (`MicrobatchResult.touched`) is not counted, and the replicas
  it names as holders are voided at that step (their sums may hold its gradient), so their
  microbatches are replayed. A verdict's own result is dropped the same way.
- **Contributions**: the audit of what a replica adds into its sums (`contributions`) is drawn
  with the step's tasks (`audited`), fed the trainers' digests with their reports (`screen`),
  and judged at the round, which bans the same way (`ban`); where digests were still out at
  the round, when they come (`screen`) or at the end of the next step's commit (`settle`).
- **Sums**: a replica owner whose round's sum checks convict it (`sum_liars`) is banned the
  same way (`ban`). The sum caught was refused before anything applied it, but a peer proven
  hostile may have lied where no check looks (an answer not sampled, a forgery within the
  norms), so its work is replayed away all the same.
- **Kept**: each ban goes to the job's `BanBook` (the scheduler's job store, bounded per job:
  `scheduler.store_bans`) before its rollback starts, and a coordinator built for the job again
  (a restarted scheduler, another attempt) starts with the bans kept: the peer is no member
  from its start, and the rollback is not run again, once it has run (`Ban.replayed`: the store
  marks it when the job's state goes back to a step at or before the ban's `since`). One that
  had not (the scheduler stopped between the ban and its rollback) runs at the new
  coordinator's first lease. Without a book (`swarm trainer --stage-servers`, tests) a ban
  lasts as long as its coordinator.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Sequence

from scheduler.coordinator.ledger import StepLedger
from scheduler.coordinator.metrics import CoordinatorMetrics
from scheduler.coordinator.trust.contributions import Contributions, Late
from scheduler.coordinator.trust.standing import Ban, Standing
from swarm.job.config import JobConfig
from swarm.net.seats import seat
from swarm.rpc.lease import MicrobatchResult, Replica, Task, Verdict

__all__ = ["Bans", "OnBan", "RollBack", "Void", "doubt_window"]

log = logging.getLogger(__name__)

RollBack = Callable[[int], None]
"""Roll every stage back to the last checkpoint at or before a step (`Rollback.to`)."""
Void = Callable[[StepLedger, int, str], Awaitable[None]]
"""Void a peer's gradients of a ledger's step at a stage (`Voids.void_duplicate`)."""
OnBan = Callable[[Ban], Awaitable[None] | None]
"""Tell the job's history and `swarm status` of a ban (`Ban.text` says it)."""
MISSED = 1e-6  # the chance a liar lying in every answer escapes the audits of its doubt window


def doubt_window(job: JobConfig | None, replicas: int) -> int | None:
    """The steps before a ban's whose work it rolls back at most (the module's docstring), for a
    stage of `replicas`: a liar among them answers about `microbatches_per_step / replicas` of
    a step's microbatches, each audited with probability `audit_fraction`. None (as far back
    as it was a member): no job (an audit-free trainer's), or no audits."""
    if job is None or job.trust.audit_fraction <= 0.0:
        return None
    fraction = job.trust.audit_fraction
    if fraction >= 1.0:
        return 1  # every answer audited: only the steps still in flight may hold a lie
    answers = max(job.training.microbatches_per_step / max(replicas, 1), 1.0)
    return max(1, math.ceil(math.log(MISSED) / (answers * math.log1p(-fraction))))


class Bans:
    """The bans of a job: verdicts judged and acted on through its `standing` (the one
    members filter) and one rollback."""

    def __init__(
        self,
        standing: Standing,
        metrics: CoordinatorMetrics,
        *,
        roll_back_to: RollBack,
        void: Void,
        on_ban: OnBan | None = None,
        job: JobConfig | None = None,
    ) -> None:
        """`standing`: who is banned and when each came (started from the bans kept);
        `roll_back_to(step)`: roll every stage back to the last checkpoint at or before `step`;
        `void(ledger, stage, peer)`: void `peer`'s gradients of `ledger`'s step at `stage`;
        `on_ban(ban)`: tell the job's history and `swarm status`; `job`: its contributions
        audited as it says (`Contributions.of`; None: not)."""
        self.standing, self.job_id, self.metrics = standing, standing.job_id, metrics
        self.roll_back_to, self.void, self.on_ban, self.job = roll_back_to, void, on_ban, job
        self._replicas: dict[int, int] = {}  # stage -> its replicas, as last seen (`saw`)
        self._addresses: dict[str, str] = {}  # peer -> where it is dialled, as last seen
        self._unconvicted: set[str] = set()  # peers a verdict of one host's seats accused
        self._origin: int | None = None  # the first step this coordinator leased work of
        self.contributions = Contributions.of(job)
        self.contributions.seat = self._seat  # its digests' auditors, as verdicts' (`_convicts`)
        # kept bans' `since`, their rollbacks not run yet
        self._unreplayed = [ban.since for ban in standing.kept if not ban.replayed]

    # What the standing says, for the job's readers (status, tests, the poison bench).
    @property
    def banned(self) -> dict[str, str]:
        """Peer -> the evidence it was banned on."""
        return self.standing.banned

    @property
    def caught_at(self) -> dict[str, int]:
        """Peer -> the step of the microbatch it was caught at."""
        return self.standing.caught_at

    @property
    def first_seen(self) -> dict[str, int]:
        """Peer -> the first step it was a member at."""
        return self.standing.first_seen

    def audited(
        self, ledger: StepLedger, tasks: list[Task], members: Sequence[Sequence[Replica]]
    ) -> list[Task]:
        """`tasks`, leased of `ledger`'s step, with the step's audits of contributions."""
        return self.contributions.tasks(ledger, tasks, members)

    def saw(self, members: Sequence[Sequence[Replica]], step: int) -> None:
        """Work of `step` was leased while these were members: their work may start there. A
        coordinator started mid-job (a scheduler restarted) cannot tell when those present at
        its start came: from step 0, for all it knows."""
        if self._origin is None:
            self._origin = step
            for since in self._unreplayed:  # kept bans whose rollback never ran: now
                log.warning(
                    "job %s: a kept ban's rollback never ran (the scheduler stopped first): "
                    "rolling back to the last checkpoint at or before step %d",
                    self.job_id,
                    since,
                )
                self.roll_back_to(since)
            self._unreplayed.clear()
        for k, stage in enumerate(members):
            self._replicas[k] = len(stage)
            for r in stage:
                self._addresses[r.peer] = r.address
                known = self.first_seen.get(r.peer)  # kept ones stand: a restart keeps them
                if known is None:
                    self.standing.came(r.peer, 0 if step == self._origin else step)
                elif step < known:  # a step replayed after a rollback: it worked there again
                    self.standing.came(r.peer, step)

    async def screen(
        self, trainer: str, result: MicrobatchResult, ledger: StepLedger | None
    ) -> bool:
        """Ban whom `result`'s audit caught; True when `result` must not count (it rests on a
        banned peer's answer): its holders voided at `ledger`'s step (None: not live), and
        `trainer`'s lease of it given back (it goes out again at once). Counts what its audit
        cost."""
        self.metrics.stage_runs.inc(result.stage_runs)
        self.metrics.audit_runs.inc(result.audit_runs)
        await self._late(self.contributions.record(result))
        # Worked on at `result.step`: a peer that joined after the step's leases went out (so
        # `saw` missed it there) may still have been routed to by a trainer following it. A
        # member some lease saw only: `touched` is the reporter's word, and any id in it was
        # kept (in the store too, a write each) and counted as a former member at entry.
        for peer in result.touched:
            if peer in self._addresses and result.step < self.first_seen.get(peer, result.step + 1):
                self.standing.came(peer, result.step)
        for verdict in result.verdicts:
            if verdict.peer not in self.banned and self._convicts(verdict):
                await self._ban(verdict.peer, verdict.stage, verdict.evidence, result.step)
        if not any(self.standing.bars(peer) for peer in result.touched):
            return False
        if ledger is not None and ledger.step == result.step:
            ledger.release(trainer, [result.index])
            for stage, peer in sorted(result.holders.items()):
                await self.void(ledger, stage, peer)
        return True

    async def settle(self, step: int) -> None:
        """Step `step` committed: the audits of contributions of the steps before it whose
        digests were still out are judged with what came (`Contributions.bound`)."""
        await self._late(self.contributions.bound(step))

    async def _late(self, found: Sequence[Late]) -> None:
        """Ban the replicas whose contributions a late judgement found wrong: as at the round,
        the rollback replays the step they were applied in away."""
        for peer, stage, evidence, step in found:
            await self.ban(peer, stage, evidence, step)

    def _convicts(self, verdict: Verdict) -> bool:
        """Whether `verdict` convicts: its auditors (where it names two or more) are seats of
        more than one host (the module's docstring)."""
        if len({self._seat(a) for a in verdict.auditors}) != 1 or len(verdict.auditors) < 2:
            return True
        if verdict.peer not in self._unconvicted:
            self._unconvicted.add(verdict.peer)
            log.warning(
                "job %s: %s is not banned: the re-executions against it (%s) are all by seats "
                "of one host, %s, whose word alone convicts no one: %s",
                self.job_id,
                verdict.peer,
                " and ".join(verdict.auditors),
                self._seat(verdict.auditors[0]),
                verdict.evidence,
            )
        return False

    def _seat(self, peer: str) -> str:
        """The host `peer` is dialled at (`swarm.net.seats`)."""
        return seat(self._addresses.get(peer, ""), peer)

    async def ban(
        self, peer: str, stage: int, evidence: str, step: int, by: str = "an audit"
    ) -> None:
        """Ban `peer`, caught at `step` (by a contribution's audit, or `by` its round's sum
        checks: `sum_liars`), unless it is already."""
        if peer not in self.banned:
            await self._ban(peer, stage, evidence, step, by)

    async def _ban(
        self, peer: str, stage: int, evidence: str, step: int, by: str = "an audit"
    ) -> None:
        self.standing.bar(peer, evidence, step)
        since = min(self.first_seen.get(peer, step), step)
        # where a credential is barred, its other ids' work is the liar's too
        others = [
            f for p, f in self.first_seen.items() if self.standing.binds and self.standing.bars(p)
        ]
        since = min([since, *others])
        # A peer admitted after its step's leases went out and caught as an auditor was seen by
        # neither `saw` nor a result's path: its first step is the one it was caught at.
        if peer not in self.first_seen:
            self.standing.came(peer, since)
        window = doubt_window(self.job, self._replicas.get(stage, 1))
        if window is not None:  # no deeper than the audits leave a steady liar unseen
            since = max(since, step - window)
        self.metrics.bans.inc()
        ban = Ban(peer, stage, step, since, evidence, by=by)
        log.warning("job %s: %s", self.job_id, ban.text)
        self.standing.keep(ban)  # kept before its rollback: a restart meanwhile runs it
        self.roll_back_to(since)
        if self.on_ban is not None:
            said = self.on_ban(ban)
            if said is not None:
                await said
