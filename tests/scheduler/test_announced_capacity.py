"""Issue 53 item 5: a replica says in its load reports how many microbatches its activation cache
holds, and a trainer's "auto" window is sized by it; so a hostile replica (or a crowd of them)
must not size a trainer's memory: what enters the scheduler's registry is believed only within
`MAX_ANNOUNCED_CAPACITY`, a replica counts at most its job's `activation_cache`, and the window
stays within `AUTO_CAP` and the microbatches live at once. The reports go through the
scheduler's own registry, its lease's wire form and a trainer, as a remote trainer gets them.

Before the bounds, a replica announcing 2^32 - 1 was kept as said, and forty replicas announcing
the most a cache can keep sized a trainer's window at the whole step (1024 microbatches in flight,
each held by the trainer)."""

from __future__ import annotations

from pathlib import Path

import pytest

from client.trainer import PipelineTrainer
from scheduler.registry import PeerRegistry
from swarm.clock import FakeClock
from swarm.job.config import JobConfig, load_job
from swarm.policy.window import AUTO_CAP, MAX_ANNOUNCED_CAPACITY
from swarm.proto import control_pb2 as cpb
from swarm.rpc.lease import Lease, lease_from_proto, lease_to_proto
from tests.support.jobs import write_job

pytestmark = [pytest.mark.timeout(30), pytest.mark.attack("53-window")]

JOB = "j"


def _serving(reg: PeerRegistry, peer: str, stage: int, capacity: int) -> None:
    reg.announce(
        cpb.PeerAnnouncement(
            peer=peer, address=f"{peer}:7000", job=JOB, stage=stage, state=cpb.PEER_STATE_SERVING
        )
    )
    reg.report_load(cpb.LoadReport(peer=peer, job=JOB, stage=stage, activation_capacity=capacity))


async def _trainer_window(job: JobConfig, reg: PeerRegistry) -> int:
    """The window a trainer takes from a lease of the registry's members, over the wire."""
    members = reg.members(JOB, job.training.stages)
    lease = lease_from_proto(lease_to_proto(Lease(0, [], members)))
    trainer = PipelineTrainer(job, coordinator=None, job_id=JOB)  # type: ignore[arg-type]
    try:
        trainer.sync(lease.replicas)
        return trainer.window
    finally:
        await trainer.close()


@pytest.fixture
def job(tmp_path: Path) -> JobConfig:
    # 1024 microbatches a step: a window sized by announcements alone would hold them all
    training = {"stages": 2, "target_batch_size": 4096}
    return load_job(write_job(tmp_path, training=training, runtime={"activation_cache": 1024}))


async def test_a_capacity_past_the_ceiling_is_not_believed(job: JobConfig) -> None:
    reg = PeerRegistry(FakeClock(), load_silence_s=10.0, serve_timeout_s=300.0)
    _serving(reg, "liar", 0, 2**32 - 1)
    _serving(reg, "honest", 1, 3)
    assert reg.capacity("liar", JOB, 0) == 0  # not said: its stage counts as the window of old
    assert reg.capacity("honest", JOB, 1) == 3
    assert await _trainer_window(job, reg) == 8


async def test_a_crowd_announcing_the_most_a_cache_keeps_moves_the_window_within_its_cap(
    job: JobConfig,
) -> None:
    reg = PeerRegistry(FakeClock(), load_silence_s=10.0, serve_timeout_s=300.0)
    for i in range(40):
        _serving(reg, f"sybil{i}", 0, MAX_ANNOUNCED_CAPACITY)
    _serving(reg, "last", 1, 0)
    assert reg.capacity("sybil0", JOB, 0) == MAX_ANNOUNCED_CAPACITY
    assert await _trainer_window(job, reg) == AUTO_CAP


async def test_a_replica_understating_what_it_holds_leaves_a_microbatch_per_stage(
    job: JobConfig,
) -> None:
    reg = PeerRegistry(FakeClock(), load_silence_s=10.0, serve_timeout_s=300.0)
    _serving(reg, "meagre", 0, 1)
    _serving(reg, "last", 1, 0)
    assert await _trainer_window(job, reg) == 2  # its two stages
