"""Issue 55: audits accuse no honest replica. A float64 job on the carry plane with every stage
of every microbatch audited (`[trust] audit_fraction = 1.0`), three replicas a stage (real gRPC
servers in this process): every audit agrees, bitwise on the CPU, nobody is banned, and the
model equals `swarm local`'s."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from client.metrics import TrainerMetrics
from client.trainer import PipelineTrainer
from scheduler.coordinator import LocalCoordinator, gather_state
from swarm.job.fingerprint import fingerprint
from tests.support.equality import assert_equal_to_local
from tests.support.inprocess import Swarm
from tests.support.jobs import make_job

pytestmark = pytest.mark.timeout(180)


async def test_an_honest_audited_job_accuses_nobody(
    tmp_path: Path, make_swarm: list[Swarm]
) -> None:
    job = make_job(
        tmp_path,
        training={"stages": 3, "steps": 4, "target_batch_size": 16},
        runtime={"data_plane": "relay"},
        trust={"audit_fraction": 1.0},
    )
    swarm = Swarm(job)
    make_swarm.append(swarm)
    await swarm.add_replicas(3)
    coordinator = LocalCoordinator(job, fingerprint(job), swarm.members)
    metrics = TrainerMetrics(fingerprint(job), CollectorRegistry())
    trainers = [PipelineTrainer(job, coordinator, metrics=metrics, seed=i) for i in range(2)]
    try:
        await coordinator.start()
        await asyncio.wait_for(
            asyncio.gather(*(t.run() for t in trainers), coordinator.finished.wait()), 120
        )
        assert coordinator.error is None
        assert_equal_to_local(job, await gather_state(coordinator), tol=1e-9)
    finally:
        for t in trainers:
            await t.close()
        await coordinator.close()
    agreed = metrics._audits.labels(job=fingerprint(job), outcome="agreed")._value.get()
    assert agreed >= 4 * 4 * 3  # every stage of every microbatch of every step
    for outcome in ("caught", "undecided", "skipped"):
        assert metrics._audits.labels(job=fingerprint(job), outcome=outcome)._value.get() == 0
    assert metrics.audit_difference._value.get() == 0.0  # bitwise, on the CPU
    assert coordinator.bans.banned == {}
    assert coordinator.metrics.bans._value.get() == 0
    # the price: every stage computation done once more
    assert metrics.audit_runs._value.get() == metrics.stage_runs._value.get()
