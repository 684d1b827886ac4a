"""One attempt at committing a step on every replica of every stage (its voids: `voids`).

1. replicas that left (or hold a gradient they must not count) are *lost*: the ledger re-needs
   their microbatches at their stage, and trainers replay them;
2. PREPARE on every replica of every stage at once: each checks its receipts and averages with
   its pool (butterfly all-reduce); a replica that fails is lost, and the step waits for replays.
   An aborted round names the members it failed on (`Aborted.missing`): the member the others
   name most is left out until it rejoins at a step boundary (of two that name each other, one
   is kept), so a replica its pool cannot reach does not abort every round of the step. The
   pool's parts are sized by its members' links, and its group may end with aggregators
   (`groups`); an aggregator named sits out the next rounds. What the round answered is then
   checked (`round_checks`: every part's sums, the norm bound, audited contributions): a
   failure fails the round, and whom it names sits out, is left out or is banned;
3. APPLY everywhere: one optimizer step. No stage leaves step t before every pool has averaged,
   so a replay can still run through the whole pipeline. Once the APPLYs are sent the step is
   decided (`decided`, the caller's: the plain synchronous rule opens the next step then, and
   a replica waits for its APPLY before it computes the next step's work, `live_steps`). An
   APPLY that did not reach a stage none of whose replicas applied is sent again, bounded
   (`apply_again`): else the stage would be lost while its replica held the step. Each
   PREPARE answers with the squared norm of its pool's averaged gradient; with
   `training.grad_clip` the coordinator sums them in stage order into the whole model's norm,
   and every APPLY carries the one clipping coefficient.
   A NaN or infinite norm from every member of a stage (clipping or not) sends no APPLY at all:
   the job fails (`NonFiniteStep`), every replica stays at the step, and checkpoints stay
   finite. So does a stage every replica of which refuses its APPLY as non-finite
   (`NonFiniteGradient`). From some members only, beside finite ones, it is their own word:
   they are left out (PREPARE) or dropped (APPLY), and the step goes on (`nonfinite`).
An attempt is a context: once it returns that the step applied, its caller (the coordinator)
ends the round that ends with the step, if any, before the attempt is over, so a straggler's
duplicate stays held through the round's end as through PREPARE and APPLY.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from scheduler.coordinator.apply_again import ApplyAgain, apply_again
from scheduler.coordinator.failures import Failed, NonFiniteStep, failed_its_part, judge
from scheduler.coordinator.groups import RoundGroup
from scheduler.coordinator.ledger import StepLedger
from scheduler.coordinator.listed import while_listed
from scheduler.coordinator.membership import restarted
from scheduler.coordinator.nonfinite import NonFinite
from scheduler.coordinator.replicas import GONE, StageReplica
from scheduler.coordinator.round_context import RoundContext
from scheduler.coordinator.round_failure import AVERAGE, LeftOut, RoundFailure, shorten
from scheduler.coordinator.round_strategy import Rounds
from scheduler.coordinator.trust.bans import Bans
from scheduler.coordinator.trust.own_norms import OwnWords, own_lies
from scheduler.coordinator.trust.round_checks import RoundAnswers, RoundChecks
from scheduler.coordinator.trust.sum_checks import Checksums, checked, new_seed
from scheduler.coordinator.voids import Voids
from swarm.errors import SwarmError
from swarm.model.optim import clip_scale
from swarm.ops import timeline
from swarm.rpc.causes import brief
from swarm.rpc.lease import Replica

__all__ = ["NonFiniteStep", "TwoPhaseCommit"]

log = logging.getLogger(__name__)


class TwoPhaseCommit:
    def __init__(
        self, context: RoundContext, rounds: Rounds, voids: Voids, bans: Bans | None = None
    ) -> None:
        """`context`: the job's, which its rounds share (`round_context`: its replicas,
        members, series, and how a pool's round group is made). `rounds`: the job's rule's
        rounds (`round_strategy`): whom a step's PREPARE averages with (what follows its APPLY
        is the caller's: `attempt`). `voids`: the job's (a straggler's duplicate held while an
        attempt decides). `bans`: the job's, with its audits of contributions."""
        self.clients, self.membership = context.clients, context.membership
        self.metrics, self.groups, self.rounds = context.metrics, context.groups, rounds
        self.grad_clip = context.job.training.grad_clip  # 0: no clipping
        self.voids, self.void, self.bans = voids, voids.void, bans
        # of each PREPARE's answers
        self.checks = RoundChecks(context, bans, self._leave_out, self.void)
        # whose NaN or infinite answer fails the job, and whose leaves its replica out
        self.nonfinite = NonFinite(self.metrics, self.membership, self._leave_out)
        self._tried: StepLedger | None = None  # the ledger of the last attempt
        # (step, peer) -> what each replica voided at the last look was voided for: the
        # receipts the ledger did not hold (None: its Info failed); `_receipts_match`
        self._voided: dict[tuple[int, str], frozenset[int] | None] = {}
        # (step, peer) of each member voided for refusing a PREPARE: a second refusal of the
        # same step leaves it out (`_prepare`)
        self._refused: set[tuple[int, str]] = set()
        # (stage, peer) -> its reports of the last PREPARE's round, and its group's parts: what
        # its own words say of the average it answered the norm of (`trust.own_norms`)
        self._words: dict[tuple[int, str], OwnWords] = {}
        self.grad_norm: float | None = None  # the whole model's, of the last step applied
        self.failure: RoundFailure | None = None  # the last attempt's PREPARE round, if it failed
        self.apply_again = ApplyAgain()  # a lost APPLY of a stage none of whose replicas applied

    @asynccontextmanager
    async def attempt(
        self, ledger: StepLedger, round_id: str, decided: Callable[[], None] | None = None
    ) -> AsyncIterator[bool]:
        """Commit `ledger`'s step under `round_id`: whether it applied; False when it must wait
        (for replays, or a retry): whatever went wrong has been lost, voided or dropped by then,
        and `failure` says so when it was the PREPARE round. The caller's block runs before the
        attempt ends (a round that ends with the step ends there: `Rounds.applied`), so a
        straggler's duplicate stays held until then. `decided()` is called once every PREPARE
        passed and the APPLYs are sent, before their answers: the step applies from then on
        (a replica that fails its APPLY rejoins later), or the job fails (`NonFiniteStep`)."""
        try:
            applied = await self._attempt(ledger, round_id, decided)
            yield applied
        finally:
            held = self.voids.decided()
        for stage, peer in held:
            if applied:
                log.info(
                    "step %d: %s's duplicate gradient at stage %d was left out of the commit",
                    ledger.step,
                    peer,
                    stage,
                )
            else:
                await self.void(ledger, stage, peer)

    async def _attempt(
        self, ledger: StepLedger, round_id: str, decided: Callable[[], None] | None
    ) -> bool:
        self.failure = None
        members = self.membership.replicas()
        for stage, replicas in enumerate(members):
            alive = {r.peer for r in replicas}
            for peer in ledger.holdings(stage):
                if peer not in alive:
                    ledger.lose(peer, stage)
        if not ledger.complete or any(not replicas for replicas in members):
            return False  # trainers replay what was lost; their reports commit again
        # A clean step's first round goes straight to PREPARE, which checks every replica's
        # receipts itself: one round trip less per step on slow links. A retry, or a step where
        # something may have left an unknown receipt, looks at every replica first.
        retry, self._tried = self._tried is ledger, ledger
        if (ledger.suspect or retry) and not await self._receipts_match(ledger, members):
            return False
        self.voids.deciding(ledger)  # from here on a straggler's duplicate is voided afterwards
        where = [(stage, r) for stage, replicas in enumerate(members) for r in replicas]
        start = timeline.now()
        reported = await self._prepare(ledger, members, where, round_id)
        timeline.span("prepare", start, timeline.now(), step=ledger.step)  # the benches'
        if reported is None:
            return False
        own = own_lies(reported, self._words)  # a NaN norm against its own reports
        self.failure = await self.nonfinite.prepared(ledger, reported, where, own)
        if self.failure is not None:
            return False  # a member's NaN beside its pool's finite norms: left out, retried
        firsts: dict[int, float] = {}  # each stage's first member's: a pool averages to one sum
        for stage, _, sq_norm in reported:
            firsts.setdefault(stage, sq_norm)
        sq_norms = list(firsts.values())  # in stage order, as `where`
        scale = clip_scale(sq_norms, self.grad_clip)
        self.grad_norm = math.sqrt(math.fsum(sq_norms))
        self.metrics.grad_norm.set(self.grad_norm)
        start = timeline.now()

        def send(client: StageReplica, stage: int) -> Awaitable[None]:
            return client.apply(ledger.step, scale)

        applying = [asyncio.ensure_future(send(self.clients.get(k, r), k)) for k, r in where]
        if decided is not None:
            decided()
        applied = await apply_again(
            f"step {ledger.step}",
            send,
            where,
            await asyncio.gather(*applying, return_exceptions=True),
            self.membership.members,
            self.clients,
            self.apply_again,
        )
        timeline.span("apply", start, timeline.now(), step=ledger.step)
        refused = self.nonfinite.applied(ledger.step, where, applied)
        for (stage, r), result in zip(where, applied, strict=True):
            # Dead or hung after averaging: the next commit's check finds it a step behind and
            # leaves it out; it rejoins by copying a replica that applied.
            if isinstance(result, BaseException) and (stage, r.peer) not in refused:
                log.warning(
                    "step %d: apply on %s (stage %d) failed: %s", ledger.step, r.peer, stage, result
                )
        return True

    async def _receipts_match(self, ledger: StepLedger, members: list[list[Replica]]) -> bool:
        """Receipts a replica holds beyond what the ledger accepted (a straggling trainer's, or a
        failed microbatch's) would poison its pool's round: void that replica first. One that
        at the next look still lists a receipt its void was for (its Discard did not clear it:
        a hostile replica, or one refusing its Discard), or whose Info failed at both, is
        dropped, said at WARNING; it rejoins at a step boundary. Voided again and again, it
        held the step's commit in a loop with no bound. A straggler's new receipt is voided
        anew, as before."""
        voided, self._voided = self._voided, {}
        stages = range(len(members))
        before = [ledger.holdings(stage) for stage in stages]
        checked = [(stage, r) for stage, replicas in enumerate(members) for r in replicas]
        infos = await asyncio.gather(
            *(self.clients.get(stage, r).info() for stage, r in checked), return_exceptions=True
        )
        # Compared with the holdings as they are now: a void may have landed meanwhile.
        holdings = [ledger.holdings(stage) for stage in stages]
        matched = True
        for (stage, r), info in zip(checked, infos, strict=True):
            if isinstance(info, GONE):  # it rejoins at a boundary
                self.membership.drop(r.peer, f"gone ({brief(info)})")
                matched = False
            elif not isinstance(info, BaseException) and info.step != ledger.step:
                self.membership.drop(r.peer, restarted(info.step, ledger.step))  # same address
                matched = False
            elif isinstance(info, BaseException) or list(info.receipts) != holdings[stage].get(
                r.peer, []
            ):
                held = frozenset(holdings[stage].get(r.peer, []))
                stray = None if isinstance(info, BaseException) else frozenset(info.receipts) - held
                if stray == frozenset():  # it lacks what a trainer's word credited it with
                    lacks = held - frozenset(info.receipts)  # type: ignore[union-attr]
                    # credited since its Info answered (a replay reported meanwhile): looked
                    # at again, not taken back
                    lacks &= frozenset(before[stage].get(r.peer, []))
                    if lacks:
                        self.voids.belied(ledger, stage, r.peer, sorted(lacks))
                    matched = False
                    continue
                why = _voided_again(voided, (ledger.step, r.peer), stray, info)
                if why is not None:
                    log.warning(
                        "step %d: %s (stage %d): %s: dropped; it rejoins at a step boundary",
                        ledger.step,
                        r.peer,
                        stage,
                        why,
                    )
                    self.membership.drop(r.peer, why)
                else:
                    self._voided[(ledger.step, r.peer)] = stray
                    await self.void(ledger, stage, r.peer)
                matched = False
        # A void that landed while the receipts were gathered (a straggler's report) emptied a
        # replica's holdings and its receipts alike: everything matches, but the ledger no
        # longer has every microbatch. PREPARE now would commit the step without one.
        return matched and holdings == before and ledger.complete

    async def _prepare(
        self,
        ledger: StepLedger,
        members: list[list[Replica]],
        where: list[tuple[int, Replica]],
        round_id: str,
    ) -> list[tuple[int, str, float]] | None:
        """PREPARE everywhere: each member's squared gradient norm, as (stage, peer, norm) in
        stage order, or None when the round failed."""
        total, calls = ledger.samples(), list[tuple[int, Replica, Awaitable[float | None]]]()
        pools: list[list[str]] = []  # the addresses each call averages with, in calls' order
        groups: dict[int, RoundGroup] = {}
        checks: dict[int, dict[int, Checksums]] = {}  # stage -> contributor -> its checksums
        taken: dict[int, dict[int, int]] = {}  # stage -> contributor -> its microbatches held
        self._words = {}
        for stage, replicas in enumerate(members):
            made = groups[stage] = self.groups.of(stage, replicas)
            seed = new_seed()  # this stage's own: a replica of another stage never learns it
            group = list(made.members)
            holdings = ledger.holdings(stage)
            for index, r in enumerate(replicas):
                samples, pool, at = self.rounds.step_pool(ledger, stage, r, group, index, total)
                # A step that averages with no one (local steps) has no parts to size.
                round_group = made if pool == group else RoundGroup(tuple(pool))
                check = checked(round_group, seed)  # with aggregators: their sums are checked
                if check is not None and self.bans is not None:  # another's contribution audited
                    check.audit_seeds = self.bans.contributions.seeds_for(
                        ledger.step, stage, r.peer
                    )
                if check is not None:
                    checks.setdefault(stage, {})[index] = check
                    taken.setdefault(stage, {})[index] = len(holdings.get(r.peer, []))
                    self._words[stage, r.peer] = OwnWords(check, owners(round_group))
                prepare = self.clients.get(stage, r).prepare(
                    ledger.step,
                    holdings.get(r.peer, []),
                    samples,
                    pool,
                    at,
                    round_id,
                    parts=round_group.parts,
                    checks=check,
                    peers=round_group.peers,
                )
                calls.append((stage, r, prepare))
                pools.append(pool)
        # A replica the registry leaves out meanwhile (hung, moved) is not waited for, nor are
        # its round's others, who wait for its parts: `listed`.
        results = await while_listed(self.membership.members, calls, "PREPARE", pools=pools)
        failed = [
            (stage, r, e)
            for (stage, r), e in zip(where, results, strict=True)
            if isinstance(e, BaseException)
        ]
        answers = RoundAnswers(ledger, round_id, members, groups, checks, taken)
        if not failed and await self.checks.passed(answers):
            # None: the member had applied the step already (a retried commit): nothing of that
            # stage is applied again, and the others' norms are what is left to clip by.
            return [
                (stage, r.peer, result)
                for (stage, r), result in zip(where, results, strict=True)
                if isinstance(result, float)
            ]
        if not failed:  # a check failed: the retry goes without whom it named
            self.failure = self.checks.failure
            return None
        await self._failed_round(ledger, round_id, failed, members, groups)
        return None

    async def _failed_round(
        self,
        ledger: StepLedger,
        round_id: str,
        failed: list[Failed],
        members: list[list[Replica]],
        groups: dict[int, RoundGroup],
    ) -> None:
        """A PREPARE round some members failed: who failed by itself (gone: dropped; could not
        do its part: left out; refused: voided, and left out where it refuses again after its
        void), and whom the others named (left out); said in `failure`."""
        self.metrics.aborted_rounds.inc(len({stage for stage, _, _ in failed}))
        judged = judge(f"step {ledger.step}: round {round_id}", failed, members)
        self.groups.blame(groups, judged.accusations)
        self.failure = failure = RoundFailure(shorten(judged.reason))
        for stage, r, error in judged.alone:
            if isinstance(error, GONE):
                # dead: its gradients are replayed
                self.membership.drop(r.peer, f"gone in round {round_id} ({brief(error)})")
            elif failed_its_part(error):  # out of memory, say: it would again, in the retry
                await self._leave_out(ledger, stage, r, [r.peer])
                failure.left_out.append(LeftOut(stage, r.peer, [r.peer], AVERAGE))
            elif (ledger.step, r.peer) in self._refused:  # voided, and it refuses again
                why = f"it refused PREPARE again after its void ({error})"
                await self._leave_out(ledger, stage, r, [r.peer], why)
                failure.left_out.append(LeftOut(stage, r.peer, [r.peer], why))
            else:
                self._refused = {k for k in self._refused if k[0] == ledger.step}
                self._refused.add((ledger.step, r.peer))
                await self._refusal(ledger, stage, r)
        explained = {stage for stage, _, _ in judged.alone}  # a member failed by itself there
        for stage, culprit, by in judged.named(members, ledger.holdings):
            if stage in explained:
                continue  # the member that failed by itself is gone or voided already
            await self._leave_out(ledger, stage, culprit, by)
            failure.left_out.append(LeftOut(stage, culprit.peer, by, AVERAGE))

    async def _refusal(self, ledger: StepLedger, stage: int, r: Replica) -> None:
        """`r` refused PREPARE: voided (it holds what it must not), unless its receipts hold
        nothing the ledger did not credit it with, and lack some: a trainer's word gave it
        what it never ran (`Voids.belied`), and nothing of its own is voided."""
        try:
            info = await self.clients.get(stage, r).info()
        except SwarmError:
            info = None
        held = frozenset(ledger.holdings(stage).get(r.peer, []))
        if info is not None and info.step == ledger.step and frozenset(info.receipts) < held:
            self.voids.belied(ledger, stage, r.peer, sorted(held - frozenset(info.receipts)))
            return
        await self.void(ledger, stage, r.peer)

    async def _leave_out(
        self,
        ledger: StepLedger,
        stage: int,
        culprit: Replica,
        named_by: list[str],
        why: str = AVERAGE,
    ) -> None:
        """`culprit`'s pool cannot average with it (`why`: what it did): its gradients are
        replayed on the others, and it takes part in no round until it rejoins (copying a
        member at a step boundary)."""
        log.warning(
            "step %d: stage %d: leaving %s out: %s named it (%s)",
            ledger.step,
            stage,
            culprit.peer,
            ", ".join(named_by),
            why,
        )
        await self.void(ledger, stage, culprit.peer)
        self.membership.drop(culprit.peer, f"{', '.join(named_by)} named it ({why})")


def _voided_again(
    voided: dict[tuple[int, str], frozenset[int] | None],
    key: tuple[int, str],
    stray: frozenset[int] | None,
    info: object,
) -> str | None:
    """Why the replica of `key` (step, peer), unmatched at this look with `stray` receipts (None:
    its Info failed), is dropped rather than voided again: it was voided at the last look for
    one it still lists, or its Info failed then too. None: void it (again)."""
    if key not in voided:
        return None
    last = voided[key]
    if stray is None and last is None:
        return f"its Info failed again ({info})"
    if stray is not None and last is not None and stray & last:
        return f"it still lists {sorted(stray & last)[:8]} after its void"
    return None


def owners(group: RoundGroup) -> frozenset[int]:
    """The places in `group` of its parts' owners (a weight of 0 owns nothing: a client)."""
    weights = group.parts.weights
    return frozenset(i for i in range(len(group.members)) if not weights or weights[i] > 0)
