"""Checkpoints from members that send what no replica would load: the state is refused where it
arrives, nothing is written from it, the next member is asked, and the last sealed checkpoint
stays the one a rollback uses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scheduler.coordinator.recovery import Recovery
from scheduler.coordinator.replicas import ReplicaClients, grpc_replicas
from stage_server.runtime import StageRuntime
from swarm.model import checkpoint
from swarm.model.stage_state import initial_state
from swarm.rpc.lease import Replica
from tests.support.hostile import HostileStage, serving
from tests.support.jobs import make_job

pytestmark = pytest.mark.timeout(60)


async def test_a_checkpoint_is_never_written_from_a_state_of_the_wrong_shape(
    tmp_path: Path,
) -> None:
    job = make_job(tmp_path, training={"stages": 1})
    whole = initial_state(job, 0)
    name = next(iter(whole))
    spoiled = {**whole, name: torch.zeros(3, dtype=torch.float64)}
    honest = HostileStage(lambda: whole.items(), step=2)
    hostile = HostileStage(lambda: spoiled.items(), step=4)
    directory = tmp_path / "checkpoints"
    clients = ReplicaClients(grpc_replicas(job, "job"))
    recovery = Recovery(job, clients, directory)
    try:
        async with serving(honest) as good, serving(hostile) as bad:
            await recovery.save(2, [[Replica("good", good)]])
            await recovery.save(4, [[Replica("bad", bad)]])
            assert checkpoint.sealed(directory) == [2]  # the one before stays the latest
            assert [d.name for d in directory.iterdir()] == ["step-00000002"]  # nothing of 4
            honest.step = 4  # a member after the refused one is asked next
            await recovery.save(4, [[Replica("bad", bad), Replica("good", good)]])
    finally:
        await clients.close()
    assert checkpoint.sealed(directory) == [2, 4]
    StageRuntime(job, 0).load_state(4, checkpoint.load_stage(directory, 4, 0))  # a replica loads it


class _Told:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t


@pytest.mark.parametrize("mode", ["step", "local"])
def test_a_checkpoint_is_due_by_time_as_well_as_by_steps(tmp_path: Path, mode: str) -> None:
    # checkpoint_every = 100 steps of a slow job: a stage lost at step 89 would cost every step.
    # With every_s the first step boundary after that long is checkpointed too (with local
    # steps, only where a round starts: replicas share parameters only there).
    pool = {"mode": mode, "sync_every": 4} if mode == "local" else {}
    job = make_job(tmp_path, training={"steps": 400, "checkpoint_every": 100}, pool=pool)
    clock = _Told()
    recovery = Recovery(job, ReplicaClients(grpc_replicas(job, "job")), tmp_path, 300.0, clock)
    assert [s for s in range(1, 101) if recovery.due(s)] == [100]
    clock.t = 299.0
    assert not recovery.due(5)
    clock.t = 300.0
    assert recovery.due(5) == (mode == "step") and recovery.due(8)
    assert not Recovery(job, ReplicaClients(grpc_replicas(job, "job")), tmp_path).due(8)
    assert not Recovery(job, ReplicaClients(grpc_replicas(job, "job")), None, 1.0, clock).due(8)
