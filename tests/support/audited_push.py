"""A push-plane job of three stages of three replicas, in this process, with every stage and
every contribution audited (`audit_fraction` 1): what the late audits' tests train
(tests/test_audit_defer.py, tests/test_audit_bound.py)."""

from __future__ import annotations

from pathlib import Path

from swarm.job.config import JobConfig
from tests.support.inprocess import Swarm
from tests.support.jobs import make_job


async def audited_push_swarm(tmp_path: Path, make_swarm: list[Swarm]) -> tuple[JobConfig, Swarm]:
    """Its job (three steps of 16 samples) and its swarm, started (`make_swarm` stops it)."""
    job = make_job(
        tmp_path,
        training={"stages": 3, "steps": 3, "target_batch_size": 16},
        runtime={"data_plane": "push"},
        trust={"audit_fraction": 1.0},
    )
    swarm = Swarm(job)
    make_swarm.append(swarm)
    await swarm.add_replicas(3)
    return job, swarm
