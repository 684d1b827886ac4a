"""The scheduler's rebalancing loop: every period, the policy's decision on the registry's measured
view of a job (`swarm.policy.rebalance.Rebalancer`, the simulator's too), published as a new
assignment. The moved peer drains; what it held at its old stage is replayed; it copies its new
stage's state at a step boundary."""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import Counter

from scheduler.assignments import Assignments
from swarm.job.config import RebalanceConfig
from swarm.policy.rebalance import Rebalancer

__all__ = ["rebalance"]

log = logging.getLogger(__name__)


async def rebalance(
    job_id: str, stages: int, config: RebalanceConfig, assignments: Assignments, moves: Counter
) -> None:
    """Run until cancelled; `moves` counts the moves ordered (label `job`)."""
    rebalancer, registry = Rebalancer(config), assignments.registry
    while True:
        await asyncio.sleep(config.period_s)
        measured = registry.measured(job_id, stages)
        if measured is None:
            continue  # decide on measured throughput only: wait for every member's report
        assignment, speeds = measured
        move = rebalancer.decide(assignment, speeds, stages, registry.clock.now())
        if move is None:
            continue
        moves.labels(job=job_id).inc()
        log.warning(
            "job %s: rebalancing: moving %s from stage %d to stage %d (bottleneck "
            "%.1f -> %.1f samples/s)",
            job_id,
            move.peer,
            move.src,
            move.dst,
            move.before,
            move.after,
        )
        await assignments.assign(job_id, move.peer, move.dst)
