"""A coordinator's start (`Rollback.reconcile`): every replica brought to the newest step its
stage's replicas hold, finishing a half-applied commit where one died with the last coordinator.
Moved out of `membership` (its members, clients and joins are what it acts through)."""

from __future__ import annotations

import logging

from scheduler.coordinator.holders import Seen, holds
from scheduler.coordinator.membership import Membership
from swarm.errors import SwarmError
from swarm.proto import stage_pb2 as pb
from swarm.rpc.causes import brief
from swarm.rpc.lease import Replica

__all__ = ["reconcile"]

log = logging.getLogger(__name__)


async def reconcile(membership: Membership, seen: Seen, recorded: int | None = None) -> int:
    """Bring every replica to the newest step, and return it. A coordinator that died while
    applying a step leaves some replicas a step behind with the step prepared: applying it
    is exact. Other laggards (new replicas, restarted ones) copy a member at that step. One
    that does not answer is left out (it rejoins at a boundary), not a reason to fail the
    start; so is one past the job's `recorded` step (`holders.holds`: a made-up id answering
    step 10^6 was the step every replica went to). Stages left with no member are the
    caller's to recover. `seen`: the look at the listed replicas it acts on."""
    infos: list[tuple[int, Replica, pb.StageInfoResponse]] = []
    unanswered: dict[int, list[str]] = {}
    membership.unanswered = unanswered
    for stage, r, info in seen.answers:
        if isinstance(info, SwarmError):
            log.warning("stage %d: %s does not answer: left out (%s)", stage, r.peer, info)
            unanswered.setdefault(stage, []).append(f"{r.peer} at {r.address}: {brief(info)}")
            continue
        if isinstance(info, BaseException):
            raise info  # a bug, not a replica's state
        if info.job != membership.job_id or info.stage != stage:
            raise SwarmError(
                f"{r.address} serves job {info.job!r} stage {info.stage}; "
                f"expected job {membership.job_id!r} stage {stage} "
                f"(same job file on both sides?)"
            )
        if recorded is not None and info.step > recorded and not holds(info.step, recorded):
            log.warning(
                "stage %d: %s says step %d, past the job's recorded step %d: not believed, "
                "left out",
                stage,
                r.peer,
                info.step,
                recorded,
            )
            continue
        infos.append((stage, r, info))
    target = max((info.step for _, _, info in infos), default=0)
    # The clipping coefficient of the step being finished, from a replica that applied it.
    scales = {i.applied_scale for _, _, i in infos if i.applied_step == target - 1}
    scale = scales.pop() if len(scales) == 1 else None if membership.grad_clip > 0 else 1.0
    at_target = set()
    for stage, r, info in infos:
        if info.step == target - 1 and scale is not None:  # else: it copies a member
            try:
                await membership.clients.get(stage, r).apply(info.step, scale)
            except SwarmError as e:
                log.warning("%s (stage %d) is a step behind: %s", r.peer, stage, e)
                continue
            log.warning("finished applying step %d on %s (stage %d)", info.step, r.peer, stage)
            at_target.add(r.peer)
        elif info.step == target:
            at_target.add(r.peer)
    membership.synced = at_target
    await membership.sync(target)
    return target
