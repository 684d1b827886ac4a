"""A failed PREPARE round's account: why it failed, and which replicas were left out of their
stage for it, or had their work of the step replayed by the others (`LeftOut`), as
`TwoPhaseCommit` records it and `swarm status` shows it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = ["AVERAGE", "LeftOut", "RoundFailure", "shorten"]

_REASON_CHARS = 600  # of a failed round's reason, in logs, status and the job's error
AVERAGE = "its pool could not average with it"  # why most are left out


class LeftOut(NamedTuple):
    """A replica left out of its stage for a failed round."""

    stage: int
    peer: str
    named_by: list[str]  # the peers (or the rule) that named it
    why: str  # what it did
    # its work of the step is replayed on the others, and it stays a member (the norm bound's
    # first refusal at a step: `trust.round_checks`)
    stays: bool = False


@dataclass
class RoundFailure:
    """A PREPARE round that failed: why (each failed replica's error), and the replicas left out
    of their stage for it."""

    reason: str
    left_out: list[LeftOut] = field(default_factory=list)

    @property
    def voided_only(self) -> bool:
        """Whether it named replicas and every one stays in its pool, its step's work replayed
        (a norm bound's first refusals: at most one a replica a step)."""
        return bool(self.left_out) and all(o.stays for o in self.left_out)

    def status(self, step: int) -> str:
        """One line for `swarm status` about those it named, left out or kept in their pool
        ("" when none was)."""
        return "; ".join(
            f"step {step}: stage {o.stage}: {o.peer} "
            + ("stays in its pool" if o.stays else "left out until it rejoins")
            + f": {o.why} (named by {', '.join(o.named_by)}); its microbatches are replayed"
            + (" on the others" if o.stays else "")
            for o in self.left_out
        )


def shorten(text: str) -> str:
    return text if len(text) <= _REASON_CHARS else text[: _REASON_CHARS - 3] + "..."
