"""Issue 63, item 2: memory stays flat through the handover over a long run. Real gRPC stage
servers in this process on the push plane (one site: every hop after the first goes through the
shared-memory handover: outputs offered, gradients into the caller's slot), a tiny model for
200 steps. Between steps (as each is committed, before the next one's pushes) no handover
segment of this process is left in /dev/shm, and after a warm-up its resident memory grows by
no more than a generous bound: nothing a push shares outlives the push."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from scheduler.coordinator import LocalCoordinator, gather_state
from swarm.job.fingerprint import fingerprint
from swarm.ops.progress import StepRecord
from swarm.wire.shm_handover import PREFIX
from swarm.wire.site import SHM_DIR
from tests.support.equality import assert_equal_to_local
from tests.support.inprocess import Swarm
from tests.support.jobs import make_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS, WARM = 200, 20
RSS_BOUND = 64 << 20  # bytes: far above what a leak-free run grows by, far below 200 steps' leak


def segments() -> int:
    mine = f"-{os.getpid()}-"
    return sum(n.startswith(PREFIX) and mine in n for n in os.listdir(SHM_DIR))


def rss() -> int:
    """This process's resident memory, bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def test_no_segment_or_memory_outlives_the_steps_of_a_long_run(
    tmp_path: Path, make_swarm: list[Swarm]
) -> None:
    job = make_job(
        tmp_path,
        training={"stages": 3, "steps": STEPS, "target_batch_size": 8},
        runtime={"data_plane": "push"},
    )
    swarm = Swarm(job)
    make_swarm.append(swarm)
    await swarm.add_replicas(1)
    left: list[int] = []  # segments as each step was committed
    resident: dict[int, int] = {}

    def on_step(record: StepRecord) -> None:
        left.append(segments())
        resident[record.step] = rss()

    coordinator = LocalCoordinator(job, fingerprint(job), swarm.members, on_step=on_step)
    try:
        await swarm.train(coordinator)
        assert_equal_to_local(job, await gather_state(coordinator), tol=1e-9)
    finally:
        await coordinator.close()
    assert len(left) >= STEPS and set(left) == {0}, left
    grown = max(resident.values()) - resident[WARM]
    assert grown < RSS_BOUND, f"{grown >> 20} MiB more after step {WARM}"
    taken = [s for s in swarm.servers[2] if handed(s, "taken")]
    assert taken, "the hops went through the handover"


def handed(server: object, way: str) -> float:
    metrics = server.servicer.metrics  # type: ignore[attr-defined]
    return float(metrics._handovers.labels(**metrics.values, way=way)._value.get())
