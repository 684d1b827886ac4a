"""What a replica lets go of when it stops serving its stage: moved to another (`serve` of the
new stage in its place, or `release` first), dropped from its job (`release`), or stopped. Its
runtime, its gradient sums, their spill file (`stage_server.averaging.spill`, kept free between
steps) and what its lossy averaging kept for the next round all go then, not when the spill
file's idle timer fires or the garbage collector next looks at old objects. Real stage servers
in this process: a pool of two that averages and commits.

The soak's peers kept a moved replica's spill file until its idle timer fired (docs/decisions.md,
"spill file"): what held it was a refused call's error (a Push whose next hop was lost), whose
traceback held the frames that held the runtime, in a reference cycle with gRPC's record of the
abort. The collector is off while a release is judged, so whatever only a cycle's collection
would free shows as held."""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Any

import pytest

from scheduler.coordinator import LocalCoordinator
from stage_server.replica.runtime import StageRuntime
from stage_server.server import RunningStageServer
from swarm.errors import FailedPrecondition
from swarm.job.fingerprint import fingerprint
from swarm.proto import stage_pb2 as pb
from swarm.rpc.stage_client import StageClient
from tests.support.collector import collector_off
from tests.support.inprocess import Swarm
from tests.support.jobs import make_job

pytestmark = pytest.mark.timeout(300)


async def _averaged(tmp_path: Path, make_swarm: list[Swarm]) -> Swarm:
    """Stage 1 served by a pool of two that averaged (in place, its sums spilled, in int8:
    its residuals kept for the next round) and committed every step of a short job."""
    job = make_job(
        tmp_path,
        "test",
        training={"stages": 2, "steps": 3, "target_batch_size": 16},
        compression={"averaging": "int8_blockwise"},
    )
    swarm = Swarm(job)
    make_swarm.append(swarm)
    for stage in (0, 1, 1):
        await swarm.add(stage)
    coordinator = LocalCoordinator(job, fingerprint(job), swarm.members)
    await swarm.train(coordinator, trainers=1)
    await coordinator.close()
    return swarm


def _spill_file(server: RunningStageServer) -> tuple[int, int]:
    """The descriptor and inode of the spill file the replica keeps free for its next step."""
    free = server.servicer.runtime.sums._spill_file._free
    assert free is not None, "the pool averaged: its last step gave its spill file back"
    return free[1], os.fstat(free[1]).st_ino


def _open(fd: int, inode: int) -> bool:
    """Whether descriptor `fd` is still the spill file of `inode` (not closed, nor reused)."""
    try:
        return os.fstat(fd).st_ino == inode
    except OSError:
        return False


class Held:
    """Weak references to what a replica holds of its stage; `alive()` names what is left."""

    def __init__(self, server: RunningStageServer) -> None:
        rt = server.servicer.runtime
        residuals = server.servicer._commits.feedback._applied
        assert residuals is not None, "int8 averaging kept residuals for the next round"
        self.refs: dict[str, weakref.ref[Any]] = {
            "runtime": weakref.ref(rt),
            "sums": weakref.ref(rt.sums),
            "spill file": weakref.ref(rt.sums._spill_file),
            "residuals": weakref.ref(residuals.residuals.sent),
        }

    def alive(self) -> list[str]:
        return [name for name, ref in self.refs.items() if ref() is not None]


async def _refused_prepare(server: RunningStageServer, job: Any) -> None:
    """A PREPARE naming a microbatch the replica does not hold (a coordinator's stale one):
    refused, as it is raised deep in the replica's commit (the frames holding its runtime)."""
    client = StageClient(server.address, job, fingerprint(job), 1)
    try:
        step = server.servicer.runtime.step
        with pytest.raises(FailedPrecondition, match="receipts missing"):
            await client.commit(step, [99], 4, phase=pb.COMMIT_PHASE_PREPARE, round="stale")
    finally:
        await client.close()


@pytest.mark.parametrize("how", ["released", "replaced"])
async def test_a_replica_that_averaged_and_refused_a_call_lets_go_of_its_stage_at_once(
    tmp_path: Path, make_swarm: list[Swarm], how: str
) -> None:
    """ "released": its job ended, or a move freed its room first (`release`); "replaced": a
    move served the new stage in its place (`serve`). Either way, right after it, nothing of
    the old stage is held: on the old code the refused PREPARE's traceback held the runtime,
    its sums and their spill file (open) until the collector's next pass, and the residuals
    stayed until the next stage's `serve`."""
    swarm = await _averaged(tmp_path, make_swarm)
    moved = swarm.servers[1][0]
    fd, inode = _spill_file(moved)
    held = Held(moved)
    with collector_off():
        await _refused_prepare(moved, swarm.job)
        if how == "released":
            moved.servicer.release()
        else:
            stage0 = StageRuntime(swarm.job, 0, moved.servicer.runtime.device)
            moved.servicer.serve(stage0, fingerprint(swarm.job))
        assert held.alive() == [], f"held after the move: {held.alive()}"
        assert not _open(fd, inode), "the old replica's spill file is still open"


async def test_a_stopped_replica_closes_its_spill_file_at_once(
    tmp_path: Path, make_swarm: list[Swarm]
) -> None:
    """A stage server stopped (its process ending, or a test's) closes its spill file as it
    stops, not when the idle timer fires: on the old code it stayed open, its timer pending."""
    swarm = await _averaged(tmp_path, make_swarm)
    stopped = swarm.servers[1][1]
    fd, inode = _spill_file(stopped)
    await stopped.stop()
    assert not _open(fd, inode), "the stopped replica's spill file is still open"
