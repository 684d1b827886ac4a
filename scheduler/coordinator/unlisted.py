"""Members unlisted, not lost: a member the scheduler no longer lists (its announcement withdrawn by
its last-will, or its load reports silent) may only have lost its link to the broker, or the
broker restarted, while the replica itself serves on and holds its stage's state.

The bus is not the judge of a replica's death (DESIGN: a stage is lost only when no replica still
holds its state). A broker restart shows it: Mosquitto sends every client's last-will as it stops,
and the peers announce themselves again in the order they reconnect, so for a moment the
scheduler lists a stage's standby without its replica, or nothing at all. Read as a loss, that
promoted the standby (issue 67's soak: 6 standbys promoted for one stage kill, each broker
restart promoting on two stages), or would have rolled back where none was at the step.

So before a stage with no member is declared lost (`Membership.readmit`), each of its former
members no longer listed is asked on the data plane, at the address it was last listed at: one
that answers at the job's step (of the last rollback's epoch) holds the stage, which waits for it
to be listed again (its bus reconnects by itself) rather than promote a standby or roll back. One
that does not answer is gone: nothing waits. The wait is bounded (`GRACE_S`): a peer whose bus
stays cut off serves nobody (trainers dial only listed members), so after it the stage goes on
without it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from swarm.deadline import within
from swarm.rpc.lease import Replica

__all__ = ["ASK_TIMEOUT_S", "GRACE_S", "Unlisted"]

log = logging.getLogger(__name__)

#: How long a stage whose only holder of its state is unlisted waits for it to be listed again
#: (seconds, from when it was first found so): a broker's restart and a peer's reconnect (its
#: bus's backoff is capped at 5 s, `swarm.bus.api.BusSettings`) take a few seconds.
GRACE_S = 30.0
#: How long an unlisted member has to answer (seconds): a live replica answers Info at once; one
#: stopped (SIGSTOP, a hung host) would hold up every stage's re-admission for its RPC timeout,
#: and a standby's promotion with it, where before its silence alone let the standby take over.
ASK_TIMEOUT_S = 2.0


class Unlisted:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._last: dict[str, tuple[int, Replica]] = {}  # member -> (stage, replica) last listed
        self._since: dict[str, float] = {}  # member found unlisted and holding -> since when

    def listed(self, members: list[list[Replica]], synced: set[str]) -> None:
        """Notes each member (`synced`) as `members` lists it now."""
        for k, stage in enumerate(members):
            for r in stage:
                if r.peer in synced:
                    self._last[r.peer] = (k, r)
                    self._since.pop(r.peer, None)

    def forget(self, peer: str) -> None:
        """`peer` is gone by the data plane's own evidence (it stopped answering calls)."""
        self._last.pop(peer, None)
        self._since.pop(peer, None)

    async def held(
        self,
        members: list[list[Replica]],
        current: list[list[Replica]],
        step: int,
        holds: Callable[[int, Replica, int], Awaitable[bool]],
    ) -> set[int]:
        """The stages with no member (`current`) that a former member not listed in `members`
        holds at `step`: `holds(stage, replica, step)` asks it, at the address it was last
        listed at."""
        empty = {k for k, stage in enumerate(current) if not stage}
        listed = {r.peer for stage in members for r in stage}
        asked = [(k, r) for p, (k, r) in self._last.items() if k in empty and p not in listed]
        answers = await asyncio.gather(
            *(within(holds(k, r, step), ASK_TIMEOUT_S) for k, r in asked),
            return_exceptions=True,
        )
        held = set()
        for (k, r), at in zip(asked, answers, strict=True):
            if isinstance(at, TimeoutError):
                log.info(
                    "stage %d: %s, unlisted, does not answer within %.0f s",
                    k,
                    r.peer,
                    ASK_TIMEOUT_S,
                )
            elif isinstance(at, BaseException):  # not a replica's answer: a bug, said as one
                log.error(
                    "stage %d: asking %s whether it holds the stage failed: %r", k, r.peer, at
                )
            if self._waits(k, r, step, at is True):
                held.add(k)
        return held

    def _waits(self, stage: int, replica: Replica, step: int, answered: bool) -> bool:
        """Whether `stage` waits for `replica`, unlisted: it `answered` at the job's `step`
        (else it is gone, and forgotten), within `GRACE_S` of when it was first found so."""
        peer = replica.peer
        if not answered:
            self.forget(peer)
            return False
        now = self.clock()
        since = self._since.setdefault(peer, now)
        if now - since > GRACE_S:
            log.warning(
                "stage %d: %s still answers at step %d but has not been listed for %.0f s (its "
                "link to the broker is down): the stage goes on without it",
                stage,
                peer,
                step,
                now - since,
            )
            self.forget(peer)
            return False
        if since == now:
            log.warning(
                "stage %d: %s is not listed (its announcement withdrawn, by its last-will as its "
                "link or the broker dropped, or by a move, or its load reports silent) but "
                "answers at step %d at %s: it holds the stage, which is not lost; waiting up "
                "to %.0f s for it to be listed again",
                stage,
                peer,
                step,
                replica.address,
                GRACE_S,
            )
        return True
