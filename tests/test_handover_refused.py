"""Issue 63, item 1: a co-located replica that refuses what is handed over to it costs its caller
one try, never a ban. Real gRPC stage servers in this process on the push plane share this
process's handover site, so every hop after the first goes through the shared-memory handover;
here every replica's take refuses, as b8f54b2's 64-byte check refused torch 2.11's 66-byte CUDA
handle. Before the fix the refusal came back as a failed hop: stage 0 banned stage 1, the trainer
banned stage 0, and the job looped on "no eligible replica" for ever. Now each replica forgets
the refusing peer's site and sends the same push on the wire at once: the job trains to `swarm
local`'s result (the handover-off result), nobody is banned and no hop fails."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from client.metrics import TrainerMetrics
from client.trainer import PipelineTrainer
from scheduler.coordinator import LocalCoordinator, gather_state
from stage_server.peer.metrics import StageMetrics
from stage_server.replica import messages
from stage_server.replica.handing import Handing
from swarm.deadline import within
from swarm.device.shm_handover import SharedMemoryHandover
from swarm.errors import InvalidArgument
from swarm.job.fingerprint import fingerprint
from swarm.proto import tensor_pb2
from tests.support.equality import assert_equal_to_local
from tests.support.inprocess import Swarm
from tests.support.jobs import make_job

pytestmark = pytest.mark.timeout(240)


class RefusingHandover(SharedMemoryHandover):
    """The CPU's handover with b8f54b2's CUDA check: a handle of any other form than the one
    it expects is "malformed", so every take is refused (its offers and slots are real)."""

    refused = 0

    def take(self, handle: tensor_pb2.Handover, nbytes: int) -> torch.Tensor:
        RefusingHandover.refused += 1
        raise InvalidArgument("a malformed CUDA handover")


async def test_a_refused_handover_goes_on_the_wire_and_bans_nobody(
    tmp_path: Path,
    make_swarm: list[Swarm],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Every replica's handover (`Messages.handing`, through `Handing`'s `make` seam) refuses.
    monkeypatch.setattr(
        messages, "Handing", lambda metrics: Handing(metrics, make=lambda _d: RefusingHandover())
    )
    RefusingHandover.refused = 0
    job = make_job(
        tmp_path,
        training={"stages": 3, "steps": 4, "target_batch_size": 16},
        runtime={"data_plane": "push"},
    )
    swarm = Swarm(job)
    make_swarm.append(swarm)
    await swarm.add_replicas(1)
    coordinator = LocalCoordinator(job, fingerprint(job), swarm.members)
    metrics = TrainerMetrics(fingerprint(job), CollectorRegistry())
    trainer = PipelineTrainer(job, coordinator, metrics=metrics, seed=0)
    try:
        with caplog.at_level(logging.INFO):
            await coordinator.start()
            await within(trainer.run(), 120)
            await within(coordinator.finished.wait(), 30)
        assert coordinator.error is None
        assert_equal_to_local(job, await gather_state(coordinator), tol=1e-9)
    finally:
        await trainer.close()
        await coordinator.close()
    # A wrong guess costs one try a push, and only for the pushes already handed over when
    # the first refusal came back: at most a step's microbatches a pair of co-located replicas
    # (stage 0 -> 1, 1 -> 2), not the 2 x 3 x 4 of the steps after the first, on the wire.
    per_step = job.training.target_batch_size // job.training.microbatch_size
    assert 2 <= RefusingHandover.refused <= 2 * per_step
    # Each sender names the refusal once at WARNING, with the receiver's cause.
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 2, warned
    assert all("handover refused" in w and "a malformed CUDA handover" in w for w in warned)
    # Nothing counted against any replica: no hop failed anywhere, nobody banned.
    hops = [r.getMessage() for r in caplog.records if r.name == "swarm.rpc.hop"]
    assert hops == []
    assert coordinator.bans.banned == {}
    failed = [s for family in metrics._failures.collect() for s in family.samples if s.value]
    assert failed == []


async def test_with_its_own_handover_a_replica_hands_over_and_refuses_nothing(
    tmp_path: Path, make_swarm: list[Swarm], caplog: pytest.LogCaptureFixture
) -> None:
    # The same job with the real handover: hops go through it (taken), none refused.
    job = make_job(
        tmp_path,
        training={"stages": 3, "steps": 3, "target_batch_size": 16},
        runtime={"data_plane": "push"},
    )
    swarm = Swarm(job)
    make_swarm.append(swarm)
    await swarm.add_replicas(1)
    coordinator = LocalCoordinator(job, fingerprint(job), swarm.members)
    try:
        with caplog.at_level(logging.INFO):
            await swarm.train(coordinator)
        assert_equal_to_local(job, await gather_state(coordinator), tol=1e-9)
    finally:
        await coordinator.close()
    assert not [r for r in caplog.records if "handover refused" in r.getMessage()]
    taken = [s for s in swarm.servers[2] if _handed(s.servicer.metrics, "taken")]
    assert taken, "the last stage took handed-over activations"


def _handed(metrics: StageMetrics, way: str) -> float:
    return float(metrics._handovers.labels(**metrics.values, way=way)._value.get())
