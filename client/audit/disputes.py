"""Disputes over a boundary on the push plane (issue 55): two replicas on either side of one
boundary who say different bytes crossed it (the sender's commitment names one digest, the
receiver's another).

Nothing signed the bytes on the wire, so one such disagreement is one word against another: it
cannot tell the sender who committed to one tensor and sent another from the receiver who says it
got what it did not. But a liar disputes with every honest replica it deals with, and an honest
replica only with liars. So a replica in dispute with two different replicas of the same
neighbouring stage, on the same side, is the liar: two replicas of a stage that say the same of
it against its one word, as two auditors outvote one answer. Framing an honest replica that way
takes two liars in one stage.

A sender picks its receiver itself (`stage_server.replica.next_hop`), and may well pick the same
one each time; so after a dispute the receiver is set aside from this trainer's routes for its
next `HOLD` microbatches, and the sender must deal with another replica of that stage: if it
lies again, that is its second dispute. Nor may the trainer's routes leave the sender alone, or a
liar that happens not to be picked again goes unconvicted: the next microbatch is routed through
the sender (`challenged`), where its stage is a sender's pick.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from swarm.rpc.lease import Verdict

__all__ = ["HOLD", "Dispute", "Disputes"]

log = logging.getLogger(__name__)

HOLD = 8  # microbatches a disputed receiver is left out of this trainer's routes
# what crosses a boundary backwards: its receiver is the earlier stage's replica
_BACKWARD = ("input gradient",)


@dataclass(frozen=True)
class Dispute:
    """`peer` (of `stage`) and `other` (of `other_stage`) disagree about `what` crossed their
    boundary at microbatch `(step, index)`."""

    peer: str
    stage: int
    other: str
    other_stage: int
    what: str
    step: int
    index: int


@dataclass
class Disputes:
    """The disputes one trainer has seen, by replica and neighbouring stage."""

    _against: dict[tuple[str, int], dict[str, Dispute]] = field(default_factory=dict)
    _aside: dict[str, int] = field(default_factory=dict)  # receiver -> microbatches left
    _challenged: set[str] = field(default_factory=set)  # senders the next microbatch goes through

    def set_aside(self) -> set[str]:
        """The receivers to leave out of the next microbatch's route (one microbatch counted)."""
        aside = set(self._aside)
        self._aside = {p: n - 1 for p, n in self._aside.items() if n > 1}
        return aside

    def challenged(self) -> set[str]:
        """The senders of a dispute the next microbatch's route goes through (taken once)."""
        challenged, self._challenged = self._challenged, set()
        return challenged

    def add(self, dispute: Dispute) -> list[Verdict]:
        """Record `dispute` (both ways); the replicas it makes liars: a replica now in dispute
        with two replicas of the same neighbouring stage."""
        d = dispute
        log.warning(
            "push audit: %s (stage %d) and %s (stage %d) disagree about the %s of microbatch "
            "(%d, %d) that crossed their boundary",
            d.peer,
            d.stage,
            d.other,
            d.other_stage,
            d.what,
            d.step,
            d.index,
        )
        flipped = Dispute(d.other, d.other_stage, d.peer, d.stage, d.what, d.step, d.index)
        later, earlier = (d, flipped) if d.stage > d.other_stage else (flipped, d)
        receiver = earlier if d.what in _BACKWARD else later
        if receiver.stage > 0:  # stage 0 is the trainer's own pick, not a sender's
            self._aside[receiver.peer] = HOLD
            sender = later if receiver is earlier else earlier
            if sender.stage > 0:  # so is a stage-0 sender
                self._challenged.add(sender.peer)
        return [v for v in (self._one(d), self._one(flipped)) if v is not None]

    def _one(self, d: Dispute) -> Verdict | None:
        against = self._against.setdefault((d.peer, d.other_stage), {})
        against[d.other] = d
        if len(against) < 2:
            return None
        first, second = sorted(against)[:2]
        a, b = against[first], against[second]
        return Verdict(
            d.peer,
            d.stage,
            f"two replicas of stage {d.other_stage}, {first} and {second}, received from it or "
            f"sent it other bytes than it committed to: the {a.what} of microbatch "
            f"({a.step}, {a.index}) and the {b.what} of ({b.step}, {b.index})",
            (first, second),
        )
