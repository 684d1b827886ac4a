"""A round whose pool sum is NaN or infinite (a local round's averaged pseudo-gradient, an eager
round's sum of shares or its last round's, the members' mean) is refused before any replica
applies it, and the job fails naming the round: one member's poisoned part reaches no replica.

The part is poisoned on one replica of stage 1 (its round's own answer, as a broken or hostile
member would send it), on an in-process swarm of two replicas per stage."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from client.trainer import PipelineTrainer
from scheduler.coordinator import LocalCoordinator
from scheduler.coordinator.commit import NonFiniteStep
from swarm.errors import SwarmError
from swarm.job.fingerprint import fingerprint
from swarm.job.rule import RuleKind
from tests.support.inprocess import Swarm
from tests.support.jobs import make_job, with_rule

pytestmark = [pytest.mark.timeout(120), pytest.mark.attack("N10")]

TRAINING = {"stages": 2, "steps": 5, "target_batch_size": 16, "checkpoint_every": 0}


@pytest.mark.parametrize(
    ("kind", "part", "boundary"),
    [
        (RuleKind.LOCAL, "prepare", 2),  # the averaged pseudo-gradient
        (RuleKind.LOCAL_EAGER, "eager_part", 2),  # EAGER_AVERAGE: the sum of the fresh shares
        (RuleKind.LOCAL_EAGER, "last_part", 5),  # EAGER_LAST: the last round's whole sum
        (RuleKind.LOCAL_EAGER, "mean_part", 5),  # EAGER_MEAN: the members' mean
        (RuleKind.STEP_EAGER, "eager_part", 1),  # a round of one step
    ],
)
async def test_a_non_finite_round_sum_reaches_no_replica_and_fails_the_job(
    tmp_path: Path, make_swarm: list[Swarm], kind: RuleKind, part: str, boundary: int
) -> None:
    job = make_job(tmp_path, **with_rule(kind, training=TRAINING, runtime={"data_plane": "relay"}))
    swarm = Swarm(job)
    make_swarm.append(swarm)
    await swarm.add_replicas(2)
    rnd = swarm.servers[1][1].runtime.round
    honest = getattr(rnd, part)

    def poisoned(*args: object) -> list[torch.Tensor]:
        return [torch.full_like(t, float("nan")) for t in honest(*args)]

    setattr(rnd, part, poisoned)
    coordinator = LocalCoordinator(job, fingerprint(job), swarm.members)
    trainers = [PipelineTrainer(job, coordinator, seed=i) for i in range(2)]
    runs: list[asyncio.Task[object]] = []
    try:
        await coordinator.start()
        runs = [asyncio.create_task(t.run()) for t in trainers]
        await asyncio.wait_for(coordinator.finished.wait(), 60)
    finally:
        for task in runs:
            task.cancel()
        await asyncio.gather(*runs, return_exceptions=True)
        for t in trainers:
            await t.close()
        await coordinator.close()
    error = coordinator.error
    assert isinstance(error, NonFiniteStep), error
    assert not isinstance(error, SwarmError)  # not retried: the same sum comes again
    assert f"the round ending at step {boundary}" in str(error), error
    assert "stage 1" in str(error), error
    for stage in swarm.servers:
        for server in stage:
            for p in server.runtime.params:
                assert torch.isfinite(p).all(), f"stage {server.runtime.stage}: {server.address}"
