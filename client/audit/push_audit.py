"""Audits by re-execution on the push plane (issue 55), where the trainer holds no boundary.

Each replica of a microbatch's path committed, as it computed, to the digests of what it received
and sent (`stage_server.replica.push_records`). After the push returns, and before anything is
drawn, the trainer asks every replica of the path for its commitment, each over its own channel
(no replica carries another's word, so none can forge a later stage's). Then:

- **Every boundary, every microbatch**: the two sides must agree about what crossed it (the
  activations and their gradient, the targets, the token ids), and stage 0 about what the trainer
  itself sent it. Stage 0 contradicting the trainer is caught at once; two replicas disagreeing
  is a dispute (`client.audit.disputes`), which names the liar once two replicas of one
  stage say the same of it. That is what catches a replica that commits to one tensor and sends
  another.
- **A sample of stages, re-executed**: `[trust] audit_fraction` of the stages, drawn from the
  operating system's randomness after the commitments, are asked for their record (the tensors
  themselves); a record that is not what its replica committed to is a lie told twice by one
  replica, caught at once; one that is goes to `Audits.judge`, which re-executes it on another
  replica of the stage, a second arbitrating, as on the carry plane.

- **Contributions**: the stages whose replica's contribution the coordinator drew
  (`Task.audits`) are redone from their neighbours' records with its seed
  (`client.audit.push_contributions`), whatever the draw above.

- **When**: after the microbatch is reported, where the trainer has somewhere to report to
  (`client.audit.late_audits`: the step may commit meanwhile, a late verdict's ban rolls it
  back; a contribution's digests that come after its round are judged as they come,
  `scheduler.coordinator.trust.contributions`); before, at the job's last step, which no later
  commit bounds.

A replica that answers nothing (gone, its record dropped) is no evidence either way.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable, Iterator, Sequence

import torch

from client.audit.audits import Audits, StageAudit, Work
from client.audit.disputes import Dispute, Disputes
from client.audit.late_audits import LateAudits, LateReport
from client.audit.push_contributions import PushContributions
from client.audit.push_fetch import Records
from swarm.errors import SwarmError
from swarm.job.config import JobConfig
from swarm.job.rule import rule_of
from swarm.model.boundary import boundary_of
from swarm.ops import timeline
from swarm.proto import stage_pb2 as pb
from swarm.rpc.lease import ContributionAudit, GradientDigest, MicrobatchResult, Task, Verdict
from swarm.rpc.routes import Routes
from swarm.wire.crossing import Crossing
from swarm.wire.digest import digest

__all__ = ["PushAudits"]

# What crosses the boundary between stages k and k+1: (the field of k's commitment, k+1's, what)
log = logging.getLogger(__name__)

_CROSSING = (
    ("outputs", "inputs", "activations"),
    ("grad_outputs", "grad_inputs", "input gradient"),
    ("targets", "targets", "targets"),
)


class PushAudits:
    """One trainer's audits of the push plane."""

    def __init__(
        self, job: JobConfig, audits: Audits, routes: Routes, report: LateReport | None = None
    ) -> None:
        """`report`: where an audit ended after its microbatch's report sends what it found
        (None: every audit ends before its microbatch is reported)."""
        self.job, self.audits, self.routes = job, audits, routes
        self.disputes = Disputes()
        self.contributions = PushContributions(job, audits, routes)
        self.late = LateAudits(audits.metrics, report)

    def run_id(self, drawn: Sequence[ContributionAudit]) -> int:
        """The id of a microbatch's run at every replica of its path (`StagePushRequest.run`),
        chosen once per run from the membership: a random one where some stage has a second
        replica to redo its work (or the coordinator `drawn` a contribution to audit), so every
        replica keeps a record; else 0, and none keeps one, nothing is asked for, fetched or
        digested: nothing is paid for an audit that cannot run (issue 69; the price comes back
        with a second replica, and goes with it). The whole path records where any stage can
        be audited: a stage's neighbours' records redo its contribution, and its neighbours'
        commitments settle a boundary's dispute."""
        redo = self.audits.reexecutor
        if drawn or any(len(redo.peers(k)) > 1 for k in range(self.job.training.stages)):
            return secrets.randbits(63) | 1  # never 0
        return 0

    def set_aside(self) -> set[str]:
        return self.disputes.set_aside()

    def challenged(self) -> set[str]:
        return self.disputes.challenged()

    def defers(self, task: Task) -> bool:
        """Whether `task`'s audit may end after its microbatch is reported: not at the job's
        last step (no later commit bounds it), nor where an auditor that applied the step keeps
        no copy of its parameters to redo it on (`delayed_update`, bf16-mixed:
        `stage_server.replica.prior_params`), which would leave the step's last audits to be
        refused. Audits past their bound are cut first."""
        self.late.cut(task.step)
        training = self.job.training
        kept = not rule_of(self.job).delays and training.precision != "bf16-mixed"
        return self.late.deferred and kept and task.step < training.steps - 1

    def later(
        self,
        done: MicrobatchResult,
        audit: Callable[[], Awaitable[tuple[tuple[Verdict, ...], int, list[GradientDigest]]]],
    ) -> None:
        """Run `audit` (`done`'s run's, `audited`) after `done` was reported; what it found goes
        to the coordinator in a report of its own (`MicrobatchResult.late`)."""

        async def reported() -> MicrobatchResult | None:
            verdicts, runs, digests = await audit()
            if not (verdicts or runs or digests):
                return None  # nothing to tell
            return MicrobatchResult(
                done.step,
                done.index,
                {},
                None,
                0,
                verdicts=verdicts,
                audit_runs=runs,
                digests=tuple(digests),
                late=True,
            )

        self.late.start(done.step, done.index, reported)

    async def settled(self, before: int) -> None:
        await self.late.settled(before)

    async def stop(self) -> None:
        await self.late.stop()

    async def audited(
        self,
        task: Task,
        run: int,
        chain: Sequence[str],
        holders: dict[int, str],
        ids: torch.Tensor,
        labels: torch.Tensor,
        loss: float,
    ) -> tuple[tuple[Verdict, ...], int, list[GradientDigest]]:
        """The push plane's audit of run `run` of `task` (`client.data_plane.push.PushTrust`):
        the contributions `task` names drawn from the stages `holders` accumulated, then
        `audit`."""
        drawn = self.contributions.drawn(chain, holders, task.audits)
        return await self.audit(task.step, task.index, run, chain, ids, labels, drawn, loss)

    async def audit(
        self,
        step: int,
        index: int,
        run: int,
        chain: Sequence[str],
        ids: torch.Tensor,
        labels: torch.Tensor,
        contributions: dict[int, int] | None = None,
        loss: float = 0.0,
    ) -> tuple[tuple[Verdict, ...], int, list[GradientDigest]]:
        """Audit run `run` of microbatch `(step, index)`, pushed through `chain` (the replica of
        each stage, in order; its `ids` and `labels`, the `loss` it answered), and the
        contributions of the stages `contributions` names (stage -> seed: `PushContributions`):
        the liars found, the re-executions it took, and the gradients' digests."""
        contributions = contributions or {}
        start = timeline.now()
        self.audits.metrics.stage_runs.inc(len(chain))
        said = await asyncio.gather(
            *(self._commitment(step, index, run, k, p) for k, p in enumerate(chain))
        )
        found: dict[str, Verdict] = {}
        for v in self._boundaries(step, index, said, ids, labels):
            found.setdefault(v.peer, v)
        drawn = set(self.audits.drawn(range(len(chain))))  # drawn now, after every commitment
        # no record tensor holds more than the microbatch's crossing of a boundary
        most = ids.numel() * max(boundary_of(self.job.model).width, 1)
        records = Records(self.routes, step, index, run, said, most)
        # Every stage at once, its records asked at once: the microbatch's report waits for the
        # slowest stage's audit, not for their sum (issue 69).
        audited = await asyncio.gather(
            *(
                self._stage(
                    step, index, k, k in drawn, contributions.get(k, 0), records, ids, labels, loss
                )
                for k in sorted(drawn | contributions.keys())
            )
        )
        lied = [v for stage in audited for v in stage.verdicts]
        for v in records.lied():  # a record not what its replica committed to: a lie told twice
            self.audits.metrics.audited("caught")
            lied.append(v)
        for v in lied:
            found.setdefault(v.peer, v)
        runs = sum(stage.runs for stage in audited)
        timeline.span("audit", start, timeline.now(), at=[step, index], runs=runs)
        return tuple(found.values()), runs, [d for stage in audited for d in stage.digests]

    async def _stage(
        self,
        step: int,
        index: int,
        k: int,
        drawn: bool,
        seed: int,
        records: Records,
        ids: torch.Tensor,
        labels: torch.Tensor,
        loss: float,
    ) -> StageAudit:
        """Stage `k`'s audits: its answers' where it is `drawn`, its contribution's where the
        coordinator drew it (`seed`), redone once for both: by the contribution's audit, which
        compares the answers too, unless it could not be redone from the neighbours' records."""
        # its own record fetched whichever the contributions' draw: its replica must not tell
        # it from this
        own = asyncio.ensure_future(self._fetched(records, k)) if drawn else None
        done, redone = StageAudit(), False
        try:
            if seed:
                done, redone = await self.contributions.audit(
                    step, index, k, seed, records, ids, labels, loss
                )
        except BaseException:  # cut or failed: the fetch beside it ends with it, not after
            if own is not None:
                own.cancel()
                await asyncio.gather(own, return_exceptions=True)
            raise
        if own is None:
            return done
        work = await own
        if work is None or redone:
            return done
        judged = await self.audits.judge(step, index, work)
        return StageAudit(
            done.verdicts + judged.verdicts, done.digests + judged.digests, done.runs + judged.runs
        )

    async def _commitment(
        self, step: int, index: int, run: int, stage: int, peer: str
    ) -> pb.Commitment | None:
        client = self.routes.clients.get(peer)
        if client is None or client.stage != stage:
            return None
        try:
            c, _ = await client.record(step, index, run, tensors=False)
        except SwarmError as e:  # gone, or its record dropped: no evidence either way
            log.info("push audit: no commitment of (%d, %d) from %s: %s", step, index, peer, e)
            return None
        if (c.stage, c.microbatch.step, c.microbatch.index, c.run) != (stage, step, index, run):
            return None
        c.peer = peer  # named as the trainer's routes name it (a verdict names it so)
        return c

    def _boundaries(
        self,
        step: int,
        index: int,
        said: Sequence[pb.Commitment | None],
        ids: torch.Tensor,
        labels: torch.Tensor,
    ) -> Iterator[Verdict]:
        """The liars the boundaries show: stage 0 against the trainer, each pair of neighbours
        against each other."""
        first = said[0]
        for name, sent in (("inputs", ids), ("targets", labels)):
            if first is not None and getattr(first, name) != digest(sent):
                yield Verdict(
                    first.peer,
                    0,
                    f"it committed to {name} of microbatch ({step}, {index}) other than the "
                    "trainer sent it",
                )
        tokens = self._tokens(ids)
        for k in range(len(said) - 1):
            a, b = said[k], said[k + 1]
            if a is None or b is None:
                continue
            checks = [(getattr(a, x), getattr(b, y), what) for x, y, what in _CROSSING]
            if k:  # the token ids as received
                checks.append((a.tokens, b.tokens, "token ids"))
            elif tokens is not None:  # as stage 0 made them from the ids
                checks.append((tokens, b.tokens, "token ids"))
            for left, right, what in checks:
                if left != right:
                    yield from self.disputes.add(
                        Dispute(a.peer, a.stage, b.peer, b.stage, what, step, index)
                    )

    def _tokens(self, ids: torch.Tensor) -> bytes | None:
        """The digest of the token ids stage 0 sends on under a subspace boundary."""
        tokens = boundary_of(self.job.model).tokens(ids)
        return None if tokens is None else digest(tokens)

    async def _fetched(self, records: Records, k: int) -> Work | None:
        """Stage `k`'s record fetched (`records`) and checked against its commitment: the work
        to re-execute elsewhere (None: nothing to redo, nobody to redo it, or a record that is
        not what was committed to, whose liar `records` names)."""
        c = records.said[k]
        # Nobody to redo it (a pool of one): its record, the stage's tensors of the microbatch,
        # is not fetched. Its bytes would cross the trainer's link for nothing: on a home link
        # they were most of what it carried (issue 52's shaped bench).
        if c is None or not self.audits.auditors(c.stage, [c.peer]):
            self.audits.metrics.audited("skipped")
            return None
        got, lied = await records.fetched(k)
        if lied:  # caught: counted where the audit takes `records.lied`
            return None
        if got is None or not {"inputs", "outputs", "grad_outputs"} <= got.messages.keys():
            self.audits.metrics.audited("skipped")  # gone, or no backward ran there: no redo
            return None
        tensors = got.messages
        return Work(
            c.stage,
            # sent on as they came (the client relabels them)
            Crossing(tensors["inputs"], tensors.get("tokens")),
            tensors["grad_outputs"],
            got.decoded["outputs"],
            got.decoded.get("grad_inputs"),
            c.peer,
            c.peer,
        )
