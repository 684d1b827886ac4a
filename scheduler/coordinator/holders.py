"""A coordinator's start waits, a bounded while, for the replicas that hold the job's recorded step.

Why: after a scheduler restart (its embedded broker restarted with it) the peers come back one
by one, over seconds. A start that judged only the peers listed at its first look rolled every
stage back to the last checkpoint when a stage's first peer back was behind (restarted empty, a
joiner mid-copy), and the replica with the trained state, listed a moment later, then loaded the
checkpoint too. Where every stage was listed behind the job store's step, the store was rewound
without a word. The store's step is what the job has trained (`JobStore.record_step`, after the
step's APPLYs): each stage's state at it is held by a replica answering that step, or the next
one (a coordinator stopped between an APPLY and its record). Nothing here decides: it waits up
to `wait_s` (the scheduler's `--lost-stage-grace-s`, as placement waits for a lost stage's
holder), saying so in the job's status, and names the stages still short when it gives up; the
start's reconcile and rollback then act on who is listed, as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from scheduler.coordinator.membership import Membership
from scheduler.coordinator.status_news import OnStatus, tell
from swarm.clock import Clock
from swarm.proto import stage_pb2 as pb
from swarm.rpc.lease import Replica

__all__ = ["AHEAD", "POLL_S", "Seen", "await_holders", "holds", "look"]

log = logging.getLogger(__name__)

POLL_S = 1.0  # how often the listed replicas are asked again while the start waits


@dataclass(frozen=True)
class Seen:
    """One look at the listed replicas: the stages, and each replica's Info answer (or the
    exception its call raised)."""

    stages: int
    answers: list[tuple[int, Replica, pb.StageInfoResponse | BaseException]]

    def short(self, recorded: int) -> list[int]:
        """The stages none of whose replicas answered a step that `holds` `recorded`."""
        held = {
            k
            for k, _, a in self.answers
            if not isinstance(a, BaseException) and holds(a.step, recorded)
        }
        return [k for k in range(self.stages) if k not in held]


# Steps a replica may be past the job's record and be believed. One: a coordinator stopped
# between a step's APPLY and its record. Two: the next step opens before a step's record is
# written (`LocalCoordinator._next_step` admits copies first), and may be applied meanwhile. A
# liar within it costs what one a step on did (its stage's target no other stage holds: the
# start rolls back); one further is not believed.
AHEAD = 2


def holds(step: int, recorded: int) -> bool:
    """Whether a replica answering `step` holds its stage's state at the job's `recorded`
    step: at it, or up to `AHEAD` steps on; a replica past that is not believed (any token
    holder may announce an id and answer any step)."""
    return recorded <= step <= recorded + AHEAD


async def look(membership: Membership) -> Seen:
    """Every listed replica's Info, asked at once."""
    members = membership.members()
    calls = [(k, r) for k, stage in enumerate(members) for r in stage]
    answers = await asyncio.gather(
        *(membership.clients.get(k, r).info() for k, r in calls), return_exceptions=True
    )
    return Seen(len(members), [(k, r, a) for (k, r), a in zip(calls, answers, strict=True)])


async def await_holders(
    membership: Membership,
    recorded: int,
    wait_s: float,
    clock: Clock,
    on_status: OnStatus | None,
) -> Seen:
    """Look until every stage lists a replica that `holds` the `recorded` step, `wait_s` at
    most (the stages still without one logged, each named); the last look."""
    deadline, said = clock.now() + wait_s, False
    while short := (seen := await look(membership)).short(recorded):
        left = deadline - clock.now()
        if left <= 0:
            for stage in short:
                log.warning(
                    "no replica of stage %d holds the job's recorded step %d after %.0f s: "
                    "starting from the replicas listed",
                    stage,
                    recorded,
                    wait_s,
                )
            return seen
        if not said:
            said = True
            until = time.strftime("%H:%M:%S", time.localtime(time.time() + left))
            text = (
                f"waiting until {until} for a replica of {_stages(short)} at step "
                f"{recorded} (the job's recorded step; --lost-stage-grace-s {wait_s:g}) before "
                "starting: the peers come back one by one after a restart; then the start goes "
                "on from the replicas listed"
            )
            log.warning("%s", text)
            await tell(on_status, text)
        await asyncio.sleep(min(POLL_S, left))
    return seen


def _stages(stages: list[int]) -> str:
    return ("stage " if len(stages) == 1 else "stages ") + ", ".join(map(str, stages))
