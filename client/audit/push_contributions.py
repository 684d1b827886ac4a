"""The contributions' audit on the push plane (issue 55, item 1; docs/decisions.md, "The
parameter-gradient audit"): what a replica adds into its gradient sums, held to its microbatches
re-executed by two others of its stage, as on the carry plane.

The coordinator draws the audited replicas and their seeds per step (`Task.audits`,
`scheduler.coordinator.trust.contributions`) and judges at the round; the trainer's part is, for
each microbatch an audited replica accumulated, a `GradientDigest` agreed bit for bit by two others
of its stage that redid it with `digest_seed` = q. On the carry plane the trainer holds the
stage's bytes; here they passed between replicas, and the audited one must not learn it is drawn
before the round, where it sends its contribution (it would send an honest one exactly when
drawn). So its own record is never asked for on its account: its **neighbours'** are.

- **The stage's bytes from either side of it**: its inputs and token ids from the trainer (stage
  0) or the stage before (what it sent), the gradient of its outputs from the stage after (what
  it sent back) or the trainer's targets (the last stage); what it answered from the stage after
  (the outputs it received) or the push's loss (the last), and from the stage before (the input
  gradient it received).
- **Vouched for by both sides**: each neighbour's tensors must be what it committed to (else it
  is caught, a lie told twice), and every tensor must hash to what the audited replica itself
  committed to having received and sent. A gap anywhere: no digest, and the coordinator skips
  that contribution's audit (no evidence either way; the boundary checks name whom they can).
- **Re-executed as the carry plane does** (`Audits.digested`): its answers are compared too, so
  a stage drawn for both audits is redone once, from this (from its own record where this could
  not be); its own record is still fetched for the answers' audit (`PushAudits`), so what it
  sees does not depend on this draw.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import torch

from client.audit.audits import Audits, StageAudit, Work
from client.audit.push_fetch import Fetched, Records
from swarm.job.config import JobConfig
from swarm.model.boundary import boundary_of
from swarm.proto import stage_pb2 as pb
from swarm.proto import tensor_pb2
from swarm.rpc.lease import ContributionAudit
from swarm.rpc.routes import Routes
from swarm.wire import codec
from swarm.wire.crossing import Crossing
from swarm.wire.digest import digest

__all__ = ["PushContributions"]

log = logging.getLogger(__name__)

# Records around a stage, whole, that are not what it committed to (`PushContributions._work`)
_CONTRADICTED = Work(-1, Crossing(torch.empty(0)), torch.empty(0), torch.empty(0), None, "", "")


class PushContributions:
    """One trainer's share of the contributions' audit on the push plane."""

    def __init__(self, job: JobConfig, audits: Audits, routes: Routes) -> None:
        self.job, self.audits, self.routes = job, audits, routes

    def drawn(
        self, chain: Sequence[str], holders: dict[int, str], drawn: Sequence[ContributionAudit]
    ) -> dict[int, int]:
        """The stages of `chain` whose accumulating replica's contribution is audited: stage ->
        its seed."""
        return {
            a.stage: a.seed
            for a in drawn
            if a.stage < len(chain) and chain[a.stage] == a.peer == holders.get(a.stage)
        }

    async def audit(
        self,
        step: int,
        index: int,
        stage: int,
        seed: int,
        records: Records,
        ids: torch.Tensor,
        labels: torch.Tensor,
        loss: float,
    ) -> tuple[StageAudit, bool]:
        """Stage `stage` of microbatch `(step, index)` re-executed with `seed` from its
        neighbours' records (`records`: the path's, both asked at once; a record that is not what
        its replica committed to is its liar's verdict there): what the audit found, and whether
        it was redone (its answers compared too)."""
        said, k = records.said, stage
        sides = [j for j in (k - 1, k + 1) if 0 <= j < len(said)]
        fetched = await asyncio.gather(*(records.fetched(j) for j in sides))
        got = dict(zip(sides, fetched, strict=True))
        before = got[k - 1][0] if k - 1 in got else None
        after = got[k + 1][0] if k + 1 in got else None
        work = self._work(k, said, before, after, ids, labels, loss)
        c = said[k]
        if work is _CONTRADICTED:
            log.warning(
                "push audit: the contribution of %s at stage %d: the tensors of microbatch "
                "(%d, %d) around it are not all what it committed to: not digested",
                c.peer if c is not None else "?",
                k,
                step,
                index,
            )
            return StageAudit(), False
        if work is None:  # as the answers' audit does (`PushAudits._fetched`): nothing to redo
            self.audits.metrics.audited("skipped")
            log.info(
                "push audit: the contribution of %s at stage %d: the records of microbatch "
                "(%d, %d) around it are not whole (a replica gone, a push it did not finish, "
                "a rollback since): no evidence either way",
                c.peer if c is not None else "?",
                k,
                step,
                index,
            )
            return StageAudit(), False
        return await self.audits.judge(step, index, work, seed), True

    def _work(
        self,
        k: int,
        said: Sequence[pb.Commitment | None],
        before: Fetched | None,
        after: Fetched | None,
        ids: torch.Tensor,
        labels: torch.Tensor,
        loss: float,
    ) -> Work | None:
        """Stage `k`'s work from its neighbours' records (`before`, `after`) and the trainer's
        own, where every tensor is what stage `k` committed to (`_CONTRADICTED` where one is
        not; None where the records are not whole: a commitment or a record not had, or one
        whose push did not finish there)."""
        c, last = said[k], len(said) - 1
        if c is None or (k > 0 and before is None) or (k < last and after is None):
            return None
        # each as sent on (a message, or the trainer's own tensor) and decoded: fetched so
        inputs: tensor_pb2.Tensor | torch.Tensor | None = (
            before.messages.get("outputs") if before is not None else codec.encode(ids, "inputs")
        )
        inputs_now = before.decoded.get("outputs") if before is not None else ids
        tokens = boundary_of(self.job.model).tokens(ids) if k > 0 else None
        grad_outputs = after.messages.get("grad_inputs") if after is not None else labels
        grad_outputs_now = after.decoded.get("grad_inputs") if after is not None else labels
        if after is not None:
            outputs = after.decoded.get("inputs")
        else:
            outputs = torch.tensor(loss, dtype=torch.float64)
        grad_inputs = before.decoded.get("grad_outputs") if before is not None else None
        if inputs is None or grad_outputs is None or outputs is None:
            return None
        if k > 0 and grad_inputs is None:
            return None
        committed = {
            "inputs": inputs_now,
            "tokens": tokens,
            "grad_outputs": grad_outputs_now,
            "outputs": outputs,
            "grad_inputs": grad_inputs,
        }
        if any(getattr(c, name) != digest(t) for name, t in committed.items()):
            return _CONTRADICTED
        if isinstance(grad_outputs, torch.Tensor):  # the last stage's targets, as the trainer sent
            grad_outputs = codec.encode(grad_outputs, "targets")
        given = Crossing(inputs, tokens)
        return Work(k, given, grad_outputs, outputs, grad_inputs, c.peer, c.peer)
