"""How the coordinator judges an averaging round that failed, once for a step's commit
(`commit`) and for a round's end (`rounds`): which members failed by themselves (gone, or
refusing), and which the others name (`culprits`), so that a replica its pool cannot reach does
not abort every round; and `CommitStalled`, what ends a run of rounds that keep failing. Each
caller acts on the judgement its own way (a commit voids and replays, a round drops)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from swarm.errors import Aborted, Busy, RemoteError, ResourceExhausted, SwarmError
from swarm.rpc.lease import Replica

__all__ = [
    "CommitStalled",
    "Failed",
    "Judgement",
    "NonFiniteStep",
    "culprits",
    "failed_its_part",
    "judge",
]

log = logging.getLogger(__name__)

Failed = tuple[int, Replica, BaseException]  # a member that failed a round: (stage, it, why)


class CommitStalled(SwarmError):
    """A step's averaging rounds failed `runtime.max_commit_rounds` times without a commit."""


class NonFiniteStep(Exception):
    """A step's averaged gradient (or a round's pool sum) is NaN or infinite at some stage: none
    of it was applied, and the job fails. Not a `SwarmError`, which the scheduler retries: the
    step's microbatches on the same parameters give the same gradient again."""


def culprits(
    group: list[Replica], accusations: dict[int, set[int]], holdings: Mapping[str, Sequence[int]]
) -> list[int]:
    """Which members (indices into `group`) to leave out of a stage whose round aborted, given
    whom each member named (`accusations`: accuser index -> named indices): those named by the
    most others. When that is every member (two that cannot reach each other name each other),
    one is kept: the one holding the most microbatches (the fewest replays), else the first."""
    votes = Counter(
        i
        for accuser, named in accusations.items()
        for i in named
        if 0 <= i < len(group) and i != accuser
    )
    if not votes:
        return []
    most = max(votes.values())
    worst = sorted(i for i, v in votes.items() if v == most)
    if len(worst) == len(group):
        keep = max(worst, key=lambda i: (len(holdings.get(group[i].peer, [])), -i))
        worst.remove(keep)
    return worst


def failed_its_part(error: BaseException) -> bool:
    """Whether a member that failed a round by itself could not do its part (out of device
    memory: `ResourceExhausted`; an error of its own: `RemoteError`), rather than refusing what
    it was asked (a stale step, receipts it does not hold). The same again would fail the same
    way: the retry goes without it, and its partners, told at once by its own abort, name it."""
    return isinstance(error, RemoteError) or (
        isinstance(error, ResourceExhausted) and not isinstance(error, Busy)
    )


def _held_by_none(stage: int) -> Mapping[str, Sequence[int]]:
    return {}


@dataclass
class Judgement:
    """A failed round's members, judged: `reason` (each one's error, in one line), `alone`
    (those that failed by themselves: gone, or refusing; not an `Aborted`), and, by stage, whom
    each member that aborted named as the one it failed on (`accusations`)."""

    reason: str
    alone: list[Failed]
    accusations: dict[int, dict[int, set[int]]]

    def named(
        self,
        members: list[list[Replica]],
        holdings: Callable[[int], Mapping[str, Sequence[int]]] = _held_by_none,
    ) -> Iterator[tuple[int, Replica, list[str]]]:
        """The members to leave out for what the others named, as (stage, member, the peers
        that named it), stage by stage; `holdings(stage)` (who holds which microbatches) is read
        as each stage is reached, so what the caller did at the stages before counts."""
        for stage, accused in self.accusations.items():
            replicas = members[stage]
            for i in culprits(replicas, accused, holdings(stage)):
                by = sorted(replicas[a].peer for a, names in accused.items() if i in names)
                yield stage, replicas[i], by


def judge(what: str, failed: list[Failed], members: list[list[Replica]]) -> Judgement:
    """Judge the members of `members` that failed round `what` (for the log: "round <id>")."""
    alone: list[Failed] = []
    accusations: dict[int, dict[int, set[int]]] = {}  # stage -> accuser -> whom it names
    for stage, r, error in failed:
        log.warning("%s at stage %d failed on %s: %r", what, stage, r.peer, error)
        if not isinstance(error, Aborted):
            alone.append((stage, r, error))
        elif error.missing:  # another member failed, and it says which
            accusations.setdefault(stage, {})[members[stage].index(r)] = set(error.missing)
        # Aborted: another member failed; this one is intact
    reason = "; ".join(f"stage {k} {r.peer}: {type(e).__name__}: {e}" for k, r, e in failed)
    return Judgement(reason, alone, accusations)
