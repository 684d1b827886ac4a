"""An APPLY lost on its way, sent again: `apply_again`.

Once every PREPARE of a step passed, the step is decided and its APPLYs go out. A replica whose
APPLY fails stays a step behind; the next commit leaves it out, and it rejoins by copying a
replica of its stage that applied. But where no replica of a stage applied (its only replica's
relay died with the APPLY in it, and the replica re-attached to another relay at once), nothing
is left to copy: the stage is lost and the whole job rolls back to a checkpoint, although the
replica holds the prepared step and answers over its new path (CI, stop 77:
tests/system/test_relay_failover.py).

So, only for such a stage, and only for a replica that did not answer at all (`PeerUnavailable`:
not a refusal, and not a deadline, after which it may still be applying), the APPLY is sent
again to the address the registry lists the peer at now (a re-attached peer's relayed address is
another), over a new connection, with backoff, a bounded number of tries, and never to a peer
the registry no longer lists at that stage. APPLY is idempotent at the replica: one that had
applied the step (the answer was lost, not the call) answers that it had, and its worker runs a
step's APPLYs one after another, so a second one never applies twice. A stage with a replica
that applied is not waited for: its others copy it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from scheduler.coordinator.listed import listed_as
from scheduler.coordinator.replicas import ReplicaClients, StageReplica
from swarm.errors import DeadlineExceeded, PeerUnavailable
from swarm.policy.backoff import Backoff
from swarm.rpc.lease import Replica

__all__ = ["ApplyAgain", "Send", "apply_again"]

log = logging.getLogger(__name__)

# One APPLY: (the replica's client, its stage) -> its answer. A step's or a round's.
Send = Callable[[StageReplica, int], Awaitable[object]]


@dataclass(frozen=True)
class ApplyAgain:
    """How often, and how far apart, a lost APPLY is sent again: `tries` in all (the first send
    among them), pauses from `first_s` doubling to `cap_s`. The defaults wait about 5 s in all:
    a relay's death is seen by its peers at once (their tunnels close), and a re-attached
    peer's announcement reached the scheduler 5 ms after the peer's own log line in the relay
    test's run (its second try came 0.1 s after the first in each of a stress run's five lost
    APPLYs); a rollback, the alternative, retrains every step since the last checkpoint."""

    tries: int = 8
    first_s: float = 0.1
    cap_s: float = 1.0


def _lost(result: object) -> bool:
    """Whether an APPLY's outcome says the call did not reach the replica's answer at all."""
    return isinstance(result, PeerUnavailable) and not isinstance(result, DeadlineExceeded)


async def apply_again(
    what: str,
    send: Send,
    where: Sequence[tuple[int, Replica]],
    results: list[object],
    members: Callable[[], list[list[Replica]]],
    clients: ReplicaClients,
    policy: ApplyAgain,
) -> list[object]:
    """`results` (one per `where`, as the APPLYs of `what` ("step 7", "the round after step 7")
    answered: their answer, or the error) with the lost APPLYs of stages where no replica
    applied sent again (`send(client, stage)`); the outcomes as they end."""
    results = list(results)
    again = _worth_again(where, results)
    for i in again:
        stage, r = where[i]
        log.warning(
            "%s: apply on %s (stage %d) got no answer: %s; no replica of stage %d "
            "applied it: sending it again (up to %d more times) rather than roll the job back",
            what,
            r.peer,
            stage,
            results[i],
            stage,
            policy.tries - 1,
        )
    backoff = Backoff(first_s=policy.first_s, cap_s=policy.cap_s)
    tries = _Tries(what, send, where, results)
    for attempt in range(2, policy.tries + 1):
        if not again:
            return results
        await backoff.sleep()
        again = await tries.send_again(again, attempt, members(), clients)
    for i in again:
        stage, r = where[i]
        log.warning(
            "%s: apply on %s (stage %d) failed %d times, the last: %s",
            what,
            r.peer,
            stage,
            policy.tries,
            results[i],
        )
    return results


def _worth_again(where: Sequence[tuple[int, Replica]], results: list[object]) -> list[int]:
    """The APPLYs lost on their way at stages where no replica applied: their indexes."""
    outcomes = list(zip(where, results, strict=True))
    applied_at = {stage for (stage, _), result in outcomes if not isinstance(result, BaseException)}
    return [
        i
        for i, ((stage, _), result) in enumerate(outcomes)
        if stage not in applied_at and _lost(result)
    ]


class _Tries:
    """The tries after the first of `what`'s lost APPLYs: `results` takes each outcome."""

    def __init__(
        self,
        what: str,
        send: Send,
        where: Sequence[tuple[int, Replica]],
        results: list[object],
    ) -> None:
        self.what, self.send, self.where, self.results = what, send, where, results
        self.sent_to = {i: r for i, (_, r) in enumerate(where)}  # where each was sent last

    async def send_again(
        self, lost: list[int], attempt: int, listed: list[list[Replica]], clients: ReplicaClients
    ) -> list[int]:
        """Try `attempt` (the first send being 1) of each of `lost`, at the address `listed`
        (the registry's) gives its peer now; those lost again."""
        sent: list[int] = []
        calls: list[Awaitable[object]] = []
        for i in lost:
            stage, r = self.where[i]
            now = listed_as(listed, stage, r.peer)
            if now is None:  # left: the registry says it is gone, and no try would reach it
                log.warning(
                    "%s: apply on %s (stage %d) given up: the registry no longer lists it",
                    self.what,
                    r.peer,
                    stage,
                )
                continue
            clients.drop(stage, self.sent_to[i])  # a failed channel waits out its reconnect backoff
            self.sent_to[i] = now
            sent.append(i)
            calls.append(self.send(clients.get(stage, now), stage))
        answered = await asyncio.gather(*calls, return_exceptions=True)
        for i, result in zip(sent, answered, strict=True):
            self.results[i] = result
            if not isinstance(result, BaseException):
                stage, r = self.where[i]
                log.warning(
                    "%s: apply on %s (stage %d) answered on try %d",
                    self.what,
                    r.peer,
                    stage,
                    attempt,
                )
        return [i for i in sent if _lost(self.results[i])]
