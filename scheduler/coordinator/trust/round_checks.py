"""What a PREPARE round's answers must pass before its step may apply (issue 55): every part's
sums against their checksums (`sum_checks`), every contribution against the norm bound
(`norm_bound`), and each audited contribution against its microbatches re-executed
(`contributions`). A round that fails any of them fails whole (nothing of it is applied: the
retry's PREPARE replaces what each replica prepared) and says whom it named:
- a replica the round's checksums convict (`sum_liars`: an owner whose sum fails against what
  it says it summed, by its own report or two others'; a member or an owner whose words about
  what was sent disagree with two others', `sent_words`) is banned (`Bans`: for good, the
  evidence in the log and the job's history, and the job rolled back past its first step); one
  that is only named (one disagreement, one accuser) is left out, its microbatches replayed by
  the others (`replicas_to_leave_out`);
- a replica past the norm bound has its gradients of the step voided and stays in its pool,
  the step's replays routed to the others (`StepLedger.routes`); refused again at the same step
  (a replay reached it all the same), it is left out. The bound is a yardstick an honest gradient
  may pass (docs/decisions.md, "Sum liars banned"): an honest replica whose microbatches were
  the step's largest costs their replay elsewhere, not a state copy;
- a contribution that is not its microbatches' is banned.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from scheduler.coordinator.groups import RoundGroup
from scheduler.coordinator.ledger import StepLedger
from scheduler.coordinator.round_context import RoundContext
from scheduler.coordinator.round_failure import LeftOut, RoundFailure, shorten
from scheduler.coordinator.trust.bans import Bans
from scheduler.coordinator.trust.disputes_kept import KeptDisputes
from scheduler.coordinator.trust.norm_bound import outliers
from scheduler.coordinator.trust.sent_words import judged
from scheduler.coordinator.trust.sum_checks import Checksums, group_hosts, replicas_to_leave_out
from scheduler.coordinator.trust.sum_liars import convicted
from swarm.rpc.lease import Replica

__all__ = ["LeaveOut", "RoundAnswers", "RoundChecks", "Void"]

log = logging.getLogger(__name__)

NORM_BOUND = "the norm bound"  # who named a replica past it, in the log and `swarm status`
# (ledger, stage, culprit, named by, why): leave `culprit` out of its stage, its work replayed
LeaveOut = Callable[[StepLedger, int, Replica, list[str], str], Awaitable[None]]
# (ledger, stage, peer): `peer`'s gradients of the step are replayed elsewhere; it stays a member
Void = Callable[[StepLedger, int, str], Awaitable[None]]


@dataclass(frozen=True)
class RoundAnswers:
    """One PREPARE round's answers, as every check reads them."""

    ledger: StepLedger
    round_id: str
    members: list[list[Replica]]  # per stage, its replicas in the round
    groups: dict[int, RoundGroup]  # per stage, the round's group (its parts, aggregators)
    checks: dict[int, dict[int, Checksums]]  # stage -> contributor -> its checksums
    taken: dict[int, dict[int, int]]  # stage -> contributor -> microbatches it held


class RoundChecks:
    def __init__(
        self, context: RoundContext, bans: Bans | None, leave_out: LeaveOut, void: Void
    ) -> None:
        """`context`: the job's rounds' (its metrics, groups and `[trust]`); `bans`: the job's
        (None: nobody is banned, a sum liar is left out); `leave_out`: the commit's; `void`: the
        job's (`Voids.void`)."""
        self.metrics, self.groups, self.job = context.metrics, context.groups, context.job
        self.bans, self.leave_out, self.void = bans, leave_out, void
        # Per stage, the median contribution per microbatch of its last round that passed: the
        # norm bound's yardstick for a replica that took every microbatch of a step.
        self._medians: dict[int, float] = {}
        self.failure: RoundFailure | None = None  # the last round's, when it failed
        self.kept = KeptDisputes()  # single disagreements, over steps

    async def passed(self, answers: RoundAnswers) -> bool:
        """Whether the round's answers pass; else whom they named is banned or left out, and
        `failure` says why when it was the sums or the norms."""
        self.failure = None
        return (
            await self._sums(answers)
            and await self._norms(answers)
            and await self._contributions(answers)
        )

    async def _contributions(self, answers: RoundAnswers) -> bool:
        """Whether each audited contribution is what its microbatches re-executed add up to
        (`contributions`). Else its replica is banned (the rollback replays its work away, the
        evidence in the log and the job's history) and the round fails."""
        if self.bans is None:
            return True
        ledger, members = answers.ledger, answers.members
        for stage, of in sorted(answers.checks.items()):
            peers, held = [r.peer for r in members[stage]], ledger.holdings(stage)
            found = self.bans.contributions.judge(ledger.step, stage, peers, of, held)
            for peer, evidence in found:
                await self.bans.ban(peer, stage, evidence, ledger.step)
            if found:
                self.metrics.aborted_rounds.inc()
                return False
        return True

    async def _sums(self, answers: RoundAnswers) -> bool:
        """Whether every part's sums pass their checksums (`sum_checks`). Else the round fails
        naming the owners: an aggregator sits out the next rounds; a replica the evidence
        convicts is banned (`sum_liars`); one only named is left out (its microbatches replayed
        by the others, so the step stays exact), with the evidence in the log and the job's
        history."""
        ledger, round_id, members = answers.ledger, answers.round_id, answers.members
        groups, checks = answers.groups, answers.checks
        accusations, lines = judged(groups, checks)
        if not lines:
            return True
        self.metrics.aborted_rounds.inc(len(accusations))
        named = self.groups.blame(groups, accusations)
        reason = f"step {ledger.step}: round {round_id}: " + "; ".join(lines)
        log.warning("%s: the round fails, and %s sit(s) out the next rounds", reason, named)
        self.failure = failure = RoundFailure(shorten(reason))
        liars = convicted(groups, checks)
        kept = self.kept.convicted(answers.ledger.step, groups, checks, members)
        for stage, found in kept.items():  # over the steps kept: `disputes_kept`
            for index, evidence in found.items():
                liars.setdefault(stage, {}).setdefault(index, evidence)
        for stage, found in liars.items():  # convicted: its word is no one's evidence now
            for index in found:
                self.kept.forget(members[stage][index].peer)
        if self.bans is not None and liars:
            # Banned, and the job rolled back past its first step: every replica loads that
            # state again, and the others named here are judged again in the replayed rounds.
            for stage, found in sorted(liars.items()):
                for index, evidence in sorted(found.items()):
                    why = f"round {round_id}: {evidence}"
                    peer = members[stage][index].peer
                    await self.bans.ban(peer, stage, why, ledger.step, "its round's sum checks")
            return False
        contributors = {k: len(g.members) - len(g.aggregators) for k, g in groups.items()}
        # With no bans, those the evidence convicts are left out alone.
        out_of = {k: {j: set[int]() for j in found} for k, found in liars.items()}
        leaving = out_of or replicas_to_leave_out(accusations, contributors, group_hosts(groups))
        for stage, out in leaving.items():
            group, failed = groups[stage].members, set().union(*accusations.get(stage, {}).values())
            for index, by in sorted(out.items()):
                culprit, accusers = members[stage][index], [group[j] for j in sorted(by)]
                why = (
                    liars[stage][index]
                    if index in liars.get(stage, {})
                    else "its part's sum fails its checksum, or its word about what it was sent"
                    if index in failed
                    else "it failed an owner's sum (or word) that too few others failed"
                )
                await self.leave_out(ledger, stage, culprit, accusers, why)
                failure.left_out.append(LeftOut(stage, culprit.peer, accusers, why))
        return False

    async def _norms(self, answers: RoundAnswers) -> bool:
        """Whether every contribution is within the job's norm bound (`norm_bound`; `[trust]`).
        Else the round fails, and each replica past it has its microbatches replayed by the
        others (exact: nothing is scaled), with the evidence in the log and the history: voided
        and routed around for the rest of the step, or left out when it was already."""
        trust = self.job.trust
        if trust.clip != "norm_bound":
            return True
        ledger, round_id, members = answers.ledger, answers.round_id, answers.members
        groups, checks, taken = answers.groups, answers.checks, answers.taken
        found: dict[int, dict[int, str]] = {}
        medians: dict[int, float] = {}
        for stage, of in checks.items():
            before = self._medians.get(stage)
            found[stage], now = outliers(
                groups[stage], of, taken.get(stage, {}), trust.norm_bound, before
            )
            if now is not None:
                medians[stage] = now
        if not any(found.values()):
            self._medians |= medians  # a round that passed: the next ones' yardstick
            return True
        self.metrics.aborted_rounds.inc(sum(1 for f in found.values() if f))
        self.metrics.refused.inc(sum(len(f) for f in found.values()))
        lines = [
            f"stage {stage}: {members[stage][j].peer}: {why} ({NORM_BOUND})"
            for stage, refused in sorted(found.items())
            for j, why in sorted(refused.items())
        ]
        reason = f"step {ledger.step}: round {round_id}: " + "; ".join(lines)
        log.warning("%s: the round fails", reason)
        self.failure = failure = RoundFailure(shorten(reason))
        for stage, refused in sorted(found.items()):
            for j, why in sorted(refused.items()):
                culprit = members[stage][j]
                if ledger.routed_around(stage, culprit.peer):  # refused again, its replays too
                    await self.leave_out(ledger, stage, culprit, [NORM_BOUND], why)
                    failure.left_out.append(LeftOut(stage, culprit.peer, [NORM_BOUND], why))
                    continue
                # A yardstick, no proof: its work is judged again on another replica, and it
                # keeps its state (a replica left out copies a member's to come back).
                log.warning(
                    "step %d: stage %d: %s's microbatches are replayed on the others, and it "
                    "stays in its pool: the norm bound named it (%s)",
                    ledger.step,
                    stage,
                    culprit.peer,
                    why,
                )
                ledger.route_around(stage, culprit.peer)
                await self.void(ledger, stage, culprit.peer)
                failure.left_out.append(LeftOut(stage, culprit.peer, [NORM_BOUND], why, stays=True))
        return False
