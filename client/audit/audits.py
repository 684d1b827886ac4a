"""Audits by re-execution (issue 55): a replica's work is checked by running it again on another
replica of its stage, from the very bytes it was given.

On the carry plane the trainer holds, for every stage of a microbatch, what it sent there (the
inputs, and the output gradient or the targets) and what came back (the outputs, or the loss, and
the input gradient): a replica is committed to its answer once it gave it, before anyone drew
what to audit. After the microbatch completes, and before it is reported, each stage is drawn
with probability `[trust] audit_fraction`, from the operating system's randomness, so no replica
can tell which of its answers will be checked. A drawn stage is re-executed on another replica of
it (an *auditor*, also drawn) and compared: within `TOLERANCE` of the job's dtype, relative to
the largest element (replicas of a stage hold bitwise the same parameters, so on the CPU honest
answers agree bitwise: the largest difference seen is kept in a gauge).

A disagreement is judged, not guessed: a second auditor re-executes too. The answer two of the
three agree on is the truth; the one that differs is the liar, the audited replica or the first
auditor alike, and comes back as a `Verdict` with the evidence. A replica that answered nothing
(gone, refused) is no evidence: the audit is skipped. Where no second auditor exists (a stage of
two), the disagreement is logged and counted, and nobody is banned on one word against another.

A replica's contribution to its pool's averaging is audited too (`ContributionAudit`, drawn by
the coordinator per step and stage; docs/decisions.md, "The parameter-gradient audit"): each
microbatch whose stage it accumulated is re-executed on two others of the stage, which digest
its parameter gradient with a seed the audited replica never learns; the two digests, equal bit
for bit, go to the coordinator (`GradientDigest`), which holds their sum to the contribution.
The second auditor's answers are held to the two others' there too, whoever agreed first. Two
digests that differ are both reported (`GradientDigest.disputed`): the coordinator tells which
is the gradient's from the round's q·x (`scheduler.coordinator.trust.digest_disputes`), so an
auditor that lies in its digest alone is convicted there.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from client.audit.answers import decoded, differs
from client.metrics import TrainerMetrics
from swarm.errors import RemoteError, SwarmError
from swarm.job.tolerance import TOLERANCE, tolerance_of
from swarm.ops.rated import RatedLog
from swarm.rpc.lease import ContributionAudit, GradientDigest, Verdict
from swarm.rpc.stage_client import TensorLike, WireCrossing

__all__ = [
    "TOLERANCE",
    "Audits",
    "Redone",
    "Reexecutor",
    "StageAudit",
    "Work",
    "decoded",
    "differs",
    "tolerance_of",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Work:
    """What one stage of a microbatch was given and answered, as the trainer holds it."""

    stage: int
    given: WireCrossing  # its inputs, and the token ids where the boundary needs them
    grad_outputs: TensorLike  # the last stage: the targets
    # As they came (encoded, or not): decoded only where the work is audited, off the loop
    # (`_claimed`); every microbatch's were decoded on it, drawn or not.
    outputs: TensorLike  # the last stage: its loss sum (a 0-d tensor)
    grad_inputs: TensorLike | None  # None where none was asked for (stage 0, the lowest)
    forward_peer: str  # who answered `outputs`
    backward_peer: str  # who answered `grad_inputs` (and accumulated the stage's gradient)


@dataclass(frozen=True)
class Redone:
    """The same work, re-executed on an auditor."""

    outputs: torch.Tensor
    grad_inputs: torch.Tensor | None
    digest: tuple[float, float, float] | None = None  # where asked: r·g, Σ|r_i·g_i|, ‖g‖


@dataclass
class _Answers:
    """The auditors asked of one microbatch and what each re-executed (None: no answer)."""

    first: str
    a: Redone | None
    second: str | None = None  # the one that arbitrates, or digests beside `first`
    b: Redone | None = None
    failed: tuple[str, ...] = ()  # asked in turn before `first`, and answered nothing

    @property
    def runs(self) -> int:
        """The re-executions it took."""
        return (self.a is not None) + (self.b is not None)


@dataclass(frozen=True)
class StageAudit:
    """One stage's audit of one microbatch: the liars found, the gradient digests (two
    auditors', or each one's where they differ) and the re-executions it took (counted here,
    not read off the trainer's counter, which concurrent audits share)."""

    verdicts: list[Verdict] = field(default_factory=list)
    digests: list[GradientDigest] = field(default_factory=list)
    runs: int = 0


class Reexecutor(Protocol):
    """Runs a stage's work again on a chosen replica, accumulating nothing (the seam: gRPC in
    `client.audit.reexecute`, fakes in unit tests)."""

    def peers(self, stage: int) -> list[str]:
        """The replicas of `stage` that can audit now."""
        ...

    async def redo(
        self, peer: str, step: int, index: int, work: Work, digest_seed: int = 0
    ) -> Redone:
        """`digest_seed`: the digest of the parameter gradient too (`Redone.digest`)."""
        ...


_ITEMS = ("outputs", "input gradients")


class Audits:
    """The audits of one trainer: `fraction` of the stages of every microbatch it completes."""

    def __init__(
        self,
        fraction: float,
        tolerance: float,
        redo: Reexecutor,
        metrics: TrainerMetrics,
        rng: random.Random | None = None,
    ) -> None:
        self.fraction, self.tolerance, self.reexecutor, self.metrics = (
            fraction,
            tolerance,
            redo,
            metrics,
        )
        # Unpredictable to every replica: drawn after their answers, from the OS's randomness.
        self.rng = rng or random.SystemRandom()
        self._failed = RatedLog(log, every_s=60.0)  # an auditor's answer of its own making

    def auditors(self, stage: int, producers: Iterable[str]) -> list[str]:
        """The replicas of `stage` that could re-execute work `producers` did (none: a pool of
        one, or every other replica gone)."""
        excluded = set(producers)
        return [p for p in self.reexecutor.peers(stage) if p not in excluded]

    def drawn(self, stages: Iterable[int]) -> list[int]:
        """The stages of one microbatch to audit, each with probability `fraction`."""
        return [k for k in stages if self.fraction > 0 and self.rng.random() < self.fraction]

    async def audit(
        self, step: int, index: int, works: Sequence[Work]
    ) -> tuple[list[Verdict], int]:
        """Audit the drawn stages of microbatch `(step, index)`: the liars found, and the
        re-executions it took."""
        verdicts, runs, _ = await self.audited(step, index, works)
        return verdicts, runs

    async def audited(
        self,
        step: int,
        index: int,
        works: Sequence[Work],
        contributions: Sequence[ContributionAudit] = (),
    ) -> tuple[list[Verdict], int, list[GradientDigest]]:
        """`audit`, and the stages whose accumulating replica's contribution is audited
        (`contributions`) audited whatever the draw, their gradients digested."""
        self.metrics.stage_runs.inc(len(works))
        drawn = set(self.drawn(range(len(works))))
        chosen = []
        for k, work in enumerate(works):
            seed = next(
                (
                    a.seed
                    for a in contributions
                    if (a.stage, a.peer) == (work.stage, work.backward_peer)
                ),
                0,
            )
            if k in drawn or seed:
                chosen.append((work, seed))
        # The stages at once, each on its own auditors: the microbatch's report waits for them.
        done = await asyncio.gather(*(self._audit(step, index, w, seed) for w, seed in chosen))
        verdicts: dict[str, Verdict] = {}
        for found in done:
            for v in found.verdicts:
                verdicts.setdefault(v.peer, v)
        digests = [d for found in done for d in found.digests]
        return list(verdicts.values()), sum(found.runs for found in done), digests

    def _close(self, a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
        return differs(a, b) <= self.tolerance

    async def _redo(
        self, peer: str, step: int, index: int, work: Work, seed: int = 0
    ) -> Redone | None:
        try:
            done = await self.reexecutor.redo(peer, step, index, work, seed)
        except SwarmError as e:  # gone, or the step moved on: no evidence either way
            where = f"audit of ({step}, {index}) at stage {work.stage} on {peer}"
            if isinstance(e, RemoteError):  # an answer of its own making (a bug, a bad reply)
                self._failed.warning(peer, "%s: %s: another auditor is asked", where, e)
            else:
                log.info("%s: %s", where, e)
            return None
        self.metrics.audit_runs.inc()
        return done

    async def judge(self, step: int, index: int, work: Work, seed: int = 0) -> StageAudit:
        """Re-execute `work` on another replica of its stage (and, if they disagree, on a
        second): the liars found, with the evidence; with `seed`, its gradient digested by two
        auditors at once, or each one's digest where they differ (the push plane's
        contributions' audit: `client.audit.push_contributions`)."""
        return await self._audit(step, index, work, seed)

    async def _audit(self, step: int, index: int, work: Work, seed: int = 0) -> StageAudit:
        """The liars found in `work`; with `seed`, its gradient's digest by two auditors (or
        each one's, where they differ)."""
        producer = _producers(work)
        others = self.auditors(work.stage, producer.values())
        if not others:
            self.metrics.audited("skipped")
            return StageAudit()
        claimed = await asyncio.to_thread(_claimed, work)
        answers = await self._ask(step, index, work, seed, others)
        a = answers.a
        if a is None:
            self.metrics.audited("skipped")
            return StageAudit(runs=answers.runs)
        if not seed:  # the arbitrator: never one that answered nothing
            answered = [o for o in others if o not in answers.failed]
            answers.second = self._second(answered, answers.first)
        first, second = answers.first, answers.second
        digest = _digest(work, seed, first, a, second, answers.b)
        redone_a = {"outputs": a.outputs, "input gradients": a.grad_inputs}
        gaps = {item: differs(claimed[item], redone_a[item]) for item in _ITEMS}
        wrong = [item for item in _ITEMS if gaps[item] > self.tolerance]
        where = f"microbatch ({step}, {index}) at stage {work.stage}"
        if not wrong:
            if second is not None and answers.b is not None:  # asked for a digest: its answers
                lied = self._outvoted(work, where, claimed, first, redone_a, second, answers.b)
                if lied is not None:
                    return StageAudit([lied], digest, answers.runs)
            self.metrics.agreed(max(gaps.values()))
            return StageAudit([], digest, answers.runs)
        tried = {answers.first, *answers.failed}
        while answers.b is None and second is not None:  # an arbitrator that answers, if any
            answers.b = await self._redo(second, step, index, work)
            tried.add(second)
            if answers.b is None:
                second = self._second([o for o in others if o not in tried], answers.first)
        answers.second = second
        if second is None or answers.b is None:
            self.metrics.audited("undecided")
            log.warning(
                "audit: %s: %s answered %s that %s's re-execution contradicts (by %.3g); no "
                "second auditor to arbitrate: nobody is banned",
                where,
                producer[wrong[0]],
                wrong[0],
                first,
                gaps[wrong[0]],
            )
            return StageAudit([], digest, answers.runs)
        verdicts = self._arbitrated(work, where, claimed, wrong, answers, redone_a, gaps)
        return StageAudit(verdicts, digest, answers.runs)

    async def _ask(
        self, step: int, index: int, work: Work, seed: int, others: Sequence[str]
    ) -> _Answers:
        """The first auditor's re-execution; with `seed`, a second's beside it (a digest needs
        two: both asked at once, neither waits for the other)."""
        first = self.rng.choice(others)
        if not seed:
            a = await self._redo(first, step, index, work)
            if a is None and (instead := self._second(others, first)) is not None:
                # The first answered nothing (gone, or an answer of its own making): one that
                # fails every re-execution must not keep its stage's work unaudited.
                a = await self._redo(instead, step, index, work)
                return _Answers(instead, a, failed=(first,))
            return _Answers(first, a)
        second = self._second(others, first)
        a, b = await asyncio.gather(
            self._redo(first, step, index, work, seed),
            self._redo(second, step, index, work, seed) if second else _nothing(),
        )
        if a is None and b is not None:  # the second's answer stands alone, as a first
            return _Answers(second, b) if second is not None else _Answers(first, None)
        return _Answers(first, a, second, b)

    def _arbitrated(
        self,
        work: Work,
        where: str,
        claimed: dict[str, torch.Tensor | None],
        wrong: list[str],
        answers: _Answers,
        redone_a: dict[str, torch.Tensor | None],
        gaps: dict[str, float],
    ) -> list[Verdict]:
        """Each item the first auditor contradicted, judged by the second's answer: where two
        of the three agree, the third lied (the producer, or the first auditor); where none
        do, nobody is banned."""
        first, second, b = answers.first, answers.second, answers.b
        assert second is not None and b is not None  # the caller's check
        producer = _producers(work)
        redone_b = {"outputs": b.outputs, "input gradients": b.grad_inputs}
        verdicts = []
        for item in wrong:
            by = differs(claimed[item], redone_b[item])
            if self._close(redone_a[item], redone_b[item]) and by > self.tolerance:
                liar, accusers, evidence = (
                    producer[item],
                    (first, second),
                    (
                        f"its {item} of {where} differ by {by:.3g} (relative) from those "
                        f"re-executed by {first} and {second}, which agree"
                    ),
                )
            elif by <= self.tolerance:
                liar, accusers, evidence = (
                    first,
                    (producer[item], second),
                    (
                        f"auditing {where}, it re-executed {item} that differ by {gaps[item]:.3g} "
                        f"(relative) from those of {producer[item]} and of {second}, which agree"
                    ),
                )
            else:
                self.metrics.audited("undecided")
                log.warning("audit: %s: no two of three answers of its %s agree", where, item)
                continue
            self.metrics.audited("caught")
            log.warning("audit: %s caught lying: %s", liar, evidence)
            verdicts.append(Verdict(liar, work.stage, evidence, accusers))
        return verdicts

    def _second(self, others: Sequence[str], first: str) -> str | None:
        """The auditor that arbitrates, or digests beside `first` (None: no other replica)."""
        seconds = [p for p in others if p != first]
        return self.rng.choice(seconds) if seconds else None

    def _outvoted(
        self,
        work: Work,
        where: str,
        claimed: dict[str, torch.Tensor | None],
        first: str,
        redone_a: dict[str, torch.Tensor | None],
        second: str,
        b: Redone,
    ) -> Verdict | None:
        """The second auditor, asked at once for a contribution's digest while the first agreed
        with the answers: convicted where its own answers differ from those two, which agree
        (otherwise a lying second auditor would go unseen: nobody compared what it said).
        `claimed`: the producers' answers, decoded (`_claimed`)."""
        producer = _producers(work)
        redone_b = {"outputs": b.outputs, "input gradients": b.grad_inputs}
        for item in _ITEMS:
            by = differs(redone_b[item], claimed[item])
            if by > self.tolerance and not self._close(redone_b[item], redone_a[item]):
                evidence = (
                    f"auditing {where}, it re-executed {item} that differ by {by:.3g} "
                    f"(relative) from those of {producer[item]} and of {first}, which agree"
                )
                self.metrics.audited("caught")
                log.warning("audit: %s caught lying: %s", second, evidence)
                return Verdict(second, work.stage, evidence, (producer[item], first))
        return None


def _claimed(work: Work) -> dict[str, torch.Tensor | None]:
    """What the producers answered, by item (`_ITEMS`), decoded (a thread's work: a lossy
    codec's decoding is compute)."""
    return {"outputs": decoded(work.outputs), "input gradients": decoded(work.grad_inputs)}


def _producers(work: Work) -> dict[str, str]:
    """Who answered each item (`_ITEMS`): the forward's peer, the backward's."""
    return {"outputs": work.forward_peer, "input gradients": work.backward_peer}


def _digest(
    work: Work, seed: int, first: str, a: Redone, second: str | None, b: Redone | None
) -> list[GradientDigest]:
    """The gradient's digest of `work` where two auditors agree on it bit for bit; where both
    answered one and they differ, each one's, `disputed` (the coordinator judges between them);
    none where not asked or a second is missing (the coordinator skips that contribution's
    audit)."""
    if not seed:
        return []
    if second is None or b is None or a.digest is None or b.digest is None:
        log.warning(
            "audit of the contribution of %s at stage %d: no two re-executions digested its "
            "gradient (%s: %s, %s: %s)",
            work.backward_peer,
            work.stage,
            first,
            a.digest,
            second,
            None if b is None else b.digest,
        )
        return []
    if a.digest == b.digest:
        return [
            GradientDigest(work.stage, work.backward_peer, *a.digest, f"{first} and {second}", seed)
        ]
    log.warning(
        "audit of the contribution of %s at stage %d: its auditors' digests of its gradient "
        "differ (%s: %s, %s: %s): the coordinator judges between them",
        work.backward_peer,
        work.stage,
        first,
        a.digest,
        second,
        b.digest,
    )
    return [
        GradientDigest(work.stage, work.backward_peer, *d, peer, seed, disputed=True)
        for peer, d in ((first, a.digest), (second, b.digest))
    ]


async def _nothing() -> None:
    return None
