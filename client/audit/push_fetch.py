"""A push-plane replica's record fetched for an audit (`client.audit.push_audit`,
`client.audit.push_contributions`): its tensors of one run of a microbatch, which must be
what it committed to before anything was drawn (`stage_server.replica.push_records`). Each
tensor is decoded once, to check it against its digest, and handed on decoded beside its message
(issue 69: the audits decoded the same bytes again for their work).

`Records` fetches each record of a run once, for whichever audit asks first, the others awaiting
the same fetch: the answers' audit of a stage and the contributions' audit of its neighbours ask
for one record alike, and each asked for its own, one after another, while the step waited for
them (issue 69)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from swarm.errors import SwarmError, WireError
from swarm.proto import stage_pb2 as pb
from swarm.proto import tensor_pb2
from swarm.rpc.lease import Verdict
from swarm.rpc.routes import Routes
from swarm.wire import codec
from swarm.wire.digest import digest
from swarm.wire.off_loop import on_thread

__all__ = ["RECORDED", "Fetched", "Records", "fetched_record"]

log = logging.getLogger(__name__)

RECORDED = ("inputs", "outputs", "grad_outputs", "grad_inputs", "tokens", "targets")


@dataclass(frozen=True)
class Fetched:
    """A record's tensors as its replica answered them (`messages`: sent on as they came) and
    decoded (`decoded`), each what it committed to."""

    messages: dict[str, tensor_pb2.Tensor]
    decoded: dict[str, torch.Tensor]


async def fetched_record(
    routes: Routes, step: int, index: int, run: int, c: pb.Commitment | None, most_values: int
) -> tuple[Fetched | None, list[Verdict]]:
    """The tensors of the record `c` commits to, asked of its replica (`c.peer`): None where it
    answers nothing (gone, its record dropped: no evidence either way), and with a verdict where
    they are not what it committed to (a lie told twice by one replica), do not decode, or one
    holds more than `most_values` (what one microbatch's crossing holds)."""
    client = None if c is None else routes.clients.get(c.peer)
    if c is None or client is None:
        return None, []
    try:
        again, tensors = await client.record(step, index, run, tensors=True)
        again.peer = c.peer
    except SwarmError as e:
        log.info("push audit: no record of (%d, %d) from %s: %s", step, index, c.peer, e)
        return None, []
    where = f"microbatch ({step}, {index}) at stage {c.stage}"
    kept = {n: t for n, t in tensors.items() if n in RECORDED}
    try:
        too_many = [(n, codec.decoded_values(t)) for n, t in kept.items()]
        too_many = [(n, v) for n, v in too_many if v > most_values]
        if too_many:  # sized by its replica: never widened, its record a lie
            n, v = too_many[0]
            evidence = (
                f"its record of {where} holds {v} values of {n!r}, more than the microbatch's "
                f"boundary holds ({most_values})"
            )
            return None, [Verdict(c.peer, c.stage, evidence)]
        # Widened and hashed off the event loop: an honest record is a microbatch's crossing
        # (millions of values of a real model), the loop the trainer's every step
        decoded, digests = await on_thread(lambda: _decoded(kept))
    except WireError as e:  # its header and its bytes disagree: no honest record does
        evidence = f"its record of {where} does not decode ({e})"
        return None, [Verdict(c.peer, c.stage, evidence)]
    wrong = [n for n in RECORDED if getattr(c, n) != digests.get(n, digest(None))]
    if again != c or wrong:
        what = ", ".join(wrong) or "its commitment"
        evidence = f"its record of {where} is not what it committed to ({what})"
        return None, [Verdict(c.peer, c.stage, evidence)]
    return Fetched(tensors, decoded), []


def _decoded(
    tensors: dict[str, tensor_pb2.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, bytes]]:
    """On a thread: each tensor decoded, and its digest."""
    decoded = {n: codec.decode(t) for n, t in tensors.items()}
    return decoded, {n: digest(t) for n, t in decoded.items()}


class Records:
    """The records of run `run` of microbatch `(step, index)` whose path committed to `said`
    (stage -> its commitment), each fetched at most once (`fetched_record`), concurrently for
    every audit that asks."""

    def __init__(
        self,
        routes: Routes,
        step: int,
        index: int,
        run: int,
        said: Sequence[pb.Commitment | None],
        most_values: int,
    ) -> None:
        self.routes, self.step, self.index, self.run, self.said = routes, step, index, run, said
        self.most_values = most_values  # of any record tensor: the microbatch's crossing
        self._asked: dict[int, asyncio.Task[tuple[Fetched | None, list[Verdict]]]] = {}

    async def fetched(self, stage: int) -> tuple[Fetched | None, list[Verdict]]:
        """Stage `stage`'s record, as `fetched_record` answers it (asked once: a second ask
        awaits the first's fetch)."""
        if stage not in self._asked:
            self._asked[stage] = asyncio.ensure_future(
                fetched_record(
                    self.routes, self.step, self.index, self.run, self.said[stage], self.most_values
                )
            )
        return await self._asked[stage]

    def lied(self) -> list[Verdict]:
        """The verdicts the records fetched so far gave, one list for each record."""
        return [v for asked in self._asked.values() if asked.done() for v in asked.result()[1]]
