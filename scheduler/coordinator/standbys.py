"""Standbys (issue 67): peers of a stage that follow its committed updates without serving, so
that a stage lost whole (one home's outage takes every replica of a small pool) goes on from the
step it was at instead of rolling every stage back to the last checkpoint.

A standby is a peer the scheduler placed on the stage that the coordinator keeps out of its
members: it copies a member and follows its updates as a joiner does (`Membership._join`, the
follow ticket its Join brings), asked again as each step opens so that it holds the step's state
within a step's opening, but never admitted while the stage has a member. Trainers see only
members, so it serves nothing. When every replica of its stage is gone, the coordinator's
re-admission before a rollback (`Membership.readmit`) finds it answering at the job's step and
makes it the stage's replica (its Discard is the scheduler's signed call, as a Join is): the
job's history says "promoted", and nothing rolls back. A standby behind the step missed updates
that died with the stage: the job rolls back as before, and the rollback says why (`missed`).

Which peers: each stage keeps `wanted` of them, chosen at a step boundary (no step of the
stage's is open, so a replica turned standby holds no work) among the stage's peers, never one
that would leave the stage without a replica, never one on the host of a replica it stands by
for, a joiner (which serves nothing yet) before a replica, standbys of one stage spread over
hosts, the slowest replica first. docs/decisions.md, "Standbys", says what this slice leaves
out.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from swarm.errors import SwarmError
from swarm.rpc.lease import Replica

__all__ = ["Standbys"]

log = logging.getLogger(__name__)

#: Told (step, stage, peer) when a standby becomes its stage's replica.
Promoted = Callable[[int, int, str], None]


class Standbys:
    def __init__(self, wanted: int = 0, host: Callable[[str], str] = lambda peer: peer) -> None:
        """`wanted`: standbys per stage (the job's `runtime.standby`; 0: none); `host(peer)`:
        the machine a peer runs on (its failure domain), never a replica's of its stage."""
        self.wanted, self.host = wanted, host
        self._stage: dict[str, int] = {}  # standby -> the stage it stands by for
        self._at: dict[str, int] = {}  # standby -> the step its last Join answered (-1: copying)
        self.promoted: list[Promoted] = []
        # Why the last stage lost whole had no standby to promote ("" none): the rollback's words.
        self.missed = ""
        self._asks: dict[str, asyncio.Task[None]] = {}  # standby -> its Join asked as a step opened

    def peers(self) -> set[str]:
        """The standbys now, of every stage."""
        return set(self._stage)

    def of(self, peer: str) -> int | None:
        """The stage `peer` stands by for (None: it is no standby)."""
        return self._stage.get(peer)

    def choose(self, members: list[list[Replica]], synced: set[str]) -> list[str]:
        """At a step boundary: forget the standbys no longer listed on their stage, and give each
        stage short of `wanted` more. Returns the members (of `synced`) made standbys: they leave
        the members before the next step opens, and copy and follow one of them from then on."""
        if not self.wanted and not self._stage:
            return []
        listed = {r.peer: k for k, stage in enumerate(members) for r in stage}
        for peer, k in list(self._stage.items()):
            if listed.get(peer) != k:
                log.info("standby %s of stage %d is gone", peer, k)
                del self._stage[peer]
                self._at.pop(peer, None)
        # A rollback loads its checkpoint on every peer listed, standbys too, which makes them
        # members: they stand by again where a replica on another host stays; one that is its
        # stage's only replica now (the others died with the rollback's cause) stays its replica.
        demoted = []
        for peer, k in list(self._stage.items()):
            if peer not in synced:
                continue
            left = {self.host(r.peer) for r in members[k] if r.peer in synced - self._stage.keys()}
            if left and self.host(peer) not in left:
                demoted.append(peer)
            else:
                log.info("standby %s is stage %d's replica now (a rollback loaded it)", peer, k)
                del self._stage[peer]
                self._at.pop(peer, None)
        for k, stage in enumerate(members):
            while sum(s == k for s in self._stage.values()) < self.wanted:
                picked = self._pick(k, stage, synced)
                if picked is None:
                    break
                self._stage[picked.peer] = k
                log.info(
                    "stage %d: %s stands by (follows its updates, serves nothing)", k, picked.peer
                )
                if picked.peer in synced:
                    demoted.append(picked.peer)
        return demoted

    def _pick(self, stage: int, listed: list[Replica], synced: set[str]) -> Replica | None:
        """The peer of `stage` (`listed`) to make its next standby, None when none may be."""
        replicas = [r for r in listed if r.peer in synced and r.peer not in self._stage]
        held = {self.host(p) for p, k in self._stage.items() if k == stage}
        fits = []
        for c in listed:
            if c.peer in self._stage:
                continue
            left = {self.host(r.peer) for r in replicas if r.peer != c.peer}
            if left and self.host(c.peer) not in left:  # a replica stays, on another host
                fits.append(c)
        # A joiner first, a host no standby of the stage is on first, the slowest replica first.
        fits.sort(key=lambda c: (c.peer in synced, self.host(c.peer) in held, c.throughput, c.peer))
        return fits[0] if fits else None

    def nudge(self, peer: Replica, join: Coroutine[Any, Any, int]) -> bool:
        """As a step opens: ask the standby `peer` (its Join, `join`, which fetches the step's
        update at once) in the background, one ask at a time; the pool never waits for a standby,
        however slow its link. False (`join` left to the caller) for a peer that is no standby."""
        if peer.peer not in self._stage:
            return False
        asking = self._asks.get(peer.peer)
        if asking is not None and not asking.done():
            join.close()  # the one before is still on its way: this one is not sent
            return True
        self._asks[peer.peer] = asyncio.ensure_future(self._ask(peer.peer, join))
        return True

    async def _ask(self, peer: str, join: Coroutine[Any, Any, int]) -> None:
        try:
            self.answered(peer, await join)
        except SwarmError as e:  # its own loop asks again; a standby gone is forgotten
            log.info("standby %s did not answer its Join: %s", peer, e)

    def asking(self) -> list[asyncio.Task[None]]:
        """The asks in flight, cancelled (the coordinator closes)."""
        for task in self._asks.values():
            task.cancel()
        return list(self._asks.values())

    def answered(self, peer: str, at: int) -> None:
        """`peer`'s Join said it is a copy at `at` (-1: still copying)."""
        if peer in self._stage:
            self._at[peer] = at

    def lag(self, peer: str, step: int) -> int | None:
        """How many steps `peer` is behind `step` (None: it holds no copy yet)."""
        at = self._at.get(peer, -1)
        return None if at < 0 else max(0, step - at)

    def words(self, peer: str, step: int, source: str) -> str:
        """What `swarm status` says of the standby `peer` at the coordinator's `step`."""
        lag, stage = self.lag(peer, step), self._stage.get(peer)
        if lag is None:
            return f"standby for stage {stage}: copying the state of {source or 'a member'}"
        steps = "step" if lag == 1 else "steps"
        return f"standby for stage {stage}, {lag} {steps} behind (following {source or 'a member'})"

    def promote(self, step: int, stage: int, peer: str) -> bool:
        """`peer`, answering at the job's `step` on `stage` that lost every replica, is its replica
        now: whether it was a standby (those told of it then)."""
        if self._stage.pop(peer, None) is None:
            return False
        self._at.pop(peer, None)
        self.missed = ""
        for told in self.promoted:
            told(step, stage, peer)
        return True

    def explain(self, lost: list[int], step: int, answered: Mapping[str, int]) -> None:
        """`lost` stages have no replica at `step` after the re-admission; `answered`: the step
        each peer looked at answered at (-1: it did not answer). Kept in `missed`."""
        if not self.wanted:
            return
        said = []
        for k in lost:
            mine = [p for p, s in self._stage.items() if s == k]
            alive = [p for p in mine if answered.get(p, -1) >= 0]
            if not alive:
                gone = f" (its standby {', '.join(mine)} was lost with it)" if mine else ""
                said.append(f"stage {k} had no standby{gone}")
                continue
            for p in alive:
                said.append(
                    f"stage {k}'s standby {p} was at step {answered[p]}, not {step}: the updates "
                    "it lacked were lost with the stage"
                )
        self.missed = "; ".join(said)
