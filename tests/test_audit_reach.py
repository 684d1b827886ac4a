"""Issue 69, item 2: nothing is paid for an audit that cannot run. Real gRPC stage servers in
this process, a trainer on the push plane, a job that audits every stage it can
(`audit_fraction` 1): with one replica a stage no audit can re-execute anything, so no replica
keeps a push record and the trainer asks for, fetches and digests none; a second replica of
one stage brings the price back, on the whole path (its neighbours' records redo a
contribution, their commitments settle a boundary's dispute)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from client.metrics import TrainerMetrics
from client.trainer import PipelineTrainer
from scheduler.coordinator import LocalCoordinator
from swarm.job.fingerprint import fingerprint
from tests.support.inprocess import Swarm
from tests.support.jobs import make_job

pytestmark = pytest.mark.timeout(180)


async def _run(
    tmp_path: Path, make_swarm: list[Swarm], pools: list[int]
) -> tuple[list[float], float]:
    """Train a two-stage push-plane job on `pools[k]` replicas of stage k: the push records
    each replica kept, and the stage runs the trainer audited (each audited run's commitments
    asked for and its boundary digests computed)."""
    job = make_job(
        tmp_path,
        training={"stages": 2, "steps": 2, "target_batch_size": 8},
        runtime={"data_plane": "push"},
        trust={"audit_fraction": 1.0},
    )
    swarm = Swarm(job)
    make_swarm.append(swarm)
    for stage, count in enumerate(pools):
        for _ in range(count):
            await swarm.add(stage)
    coordinator = LocalCoordinator(job, fingerprint(job), swarm.members)
    metrics = TrainerMetrics(fingerprint(job), CollectorRegistry())
    trainer = PipelineTrainer(job, coordinator, metrics=metrics, seed=0)
    try:
        await coordinator.start()
        await asyncio.wait_for(asyncio.gather(trainer.run(), coordinator.finished.wait()), 120)
        assert coordinator.error is None
    finally:
        await trainer.close()
        await coordinator.close()
    kept = [s.servicer.metrics.records_kept() for stage in swarm.servers for s in stage]
    return kept, metrics.stage_runs._value.get()


async def test_a_pool_of_one_keeps_no_records_and_digests_nothing(
    tmp_path: Path, make_swarm: list[Swarm]
) -> None:
    kept, audited = await _run(tmp_path, make_swarm, [1, 1])
    assert kept == [0.0, 0.0]
    assert audited == 0.0


async def test_a_second_replica_brings_the_records_back(
    tmp_path: Path, make_swarm: list[Swarm]
) -> None:
    kept, audited = await _run(tmp_path, make_swarm, [1, 2])
    assert kept[0] > 0  # stage 0's only replica too: its neighbour's audit needs its record
    assert sum(kept[1:]) > 0
    assert audited > 0
