"""Issue 63, item 2: memory stays flat through the handover over a long run. Real gRPC stage
servers in this process on the push plane (one site: every hop after the first goes through the
handover: outputs offered, gradients into the caller's slot), a tiny model for 200 steps.
As each step's record is made, no handover segment of this process made before it is left in
/dev/shm by the next step's record, none at all is left at the last one, and after a warm-up
its resident memory grows by no more than a generous bound: nothing a push shares outlives the
push. (Step t+1 opens once step t is decided, before its record: its pushes may be in flight as
step t's record is made, so a segment seen then is step t+1's, and gone by step t+1's record;
one that leaked stays, and is seen at both.) The same run through the CUDA handover's logic on
its CPU stand-in (each server a process of one stand-in device, mapping the others' allocations
as CUDA IPC does): no allocation a share made is alive past the next step's record, none at the
last one: none kept for a receiver that never came (torch's limbo)."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

from scheduler.coordinator import LocalCoordinator, gather_state
from stage_server.replica import messages
from stage_server.replica.handing import Handing
from swarm.device.cuda_handover import CudaHandover
from swarm.device.cuda_ipc import HostDevice, HostIpc
from swarm.device.shm_handover import PREFIX
from swarm.device.site import SHM_DIR
from swarm.job.fingerprint import fingerprint
from swarm.ops.progress import StepRecord
from tests.support.equality import assert_equal_to_local
from tests.support.inprocess import Swarm
from tests.support.jobs import make_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS, WARM = 200, 20
RSS_BOUND = 64 << 20  # bytes: far above what a leak-free run grows by, far below 200 steps' leak


def segments() -> frozenset[str]:
    """This process's handover segments in /dev/shm now, by name."""
    mine = f"-{os.getpid()}-"
    return frozenset(n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX) and mine in n)


def outlived(seen: dict[int, frozenset[str]] | dict[int, frozenset[bytes]]) -> dict[int, int]:
    """Step -> how many of what was seen at its record were still seen at the next step's."""
    return {t: len(seen[t] & seen[t + 1]) for t in seen if t + 1 in seen and seen[t] & seen[t + 1]}


def rss() -> int:
    """This process's resident memory, bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize("handover", ["shm", "cuda-standin"])
async def test_no_share_or_memory_outlives_the_steps_of_a_long_run(
    tmp_path: Path, make_swarm: list[Swarm], monkeypatch: pytest.MonkeyPatch, handover: str
) -> None:
    device = HostDevice()
    if handover == "cuda-standin":  # every server its own process of one stand-in device

        def standin(metrics: object) -> Handing:
            make = lambda d: CudaHandover(d, HostIpc(device))  # noqa: E731
            return Handing(metrics, make=make)  # type: ignore[arg-type]

        monkeypatch.setattr(messages, "Handing", standin)
    job = make_job(
        tmp_path,
        training={"stages": 3, "steps": STEPS, "target_batch_size": 8},
        runtime={"data_plane": "push"},
        # audited: a replica that keeps a record answers its gradient with bytes, not into the
        # caller's slot (a share nobody maps), as a busy or refusing one would leave it
        trust={"audit_fraction": 1.0},
    )
    swarm = Swarm(job)
    make_swarm.append(swarm)
    await swarm.add_replicas(1)
    # a second replica of stage 1: records are kept only where an audit can run (issue 69)
    await swarm.add(1)
    left: dict[int, frozenset[str]] = {}  # segments as each step's record was made
    # shared allocations alive as every tenth step's record, and the next one's, were made
    alive: dict[int, frozenset[bytes]] = {}
    resident: dict[int, int] = {}

    def on_step(record: StepRecord) -> None:
        left[record.step] = segments()
        resident[record.step] = rss()
        last = record.step == STEPS - 1
        if record.step % 10 in (0, 1) or last:  # (a collection costs a fair share of a step)
            gc.collect()  # what nothing refers to is gone, as it would be from a GPU's memory
            alive[record.step] = device.alive()

    coordinator = LocalCoordinator(job, fingerprint(job), swarm.members, on_step=on_step)
    # Everything alive before the first step (torch, the servers, the coordinator: millions of
    # objects) is set aside from the collections: each went through all of it, two thirds of
    # the run. What the steps allocate is collected as before; a cycle of that setting-aside
    # keeps alive could only fail the run, never pass it.
    gc.freeze()
    try:
        await swarm.train(coordinator)
        assert_equal_to_local(job, await gather_state(coordinator), tol=1e-9)
    finally:
        gc.unfreeze()
        await coordinator.close()
    assert len(left) >= STEPS and not outlived(left), outlived(left)
    assert not left[STEPS - 1], f"left at the last step's record: {left[STEPS - 1]}"
    assert not outlived(alive), outlived(alive)
    assert not alive[STEPS - 1], f"alive at the last step's record: {len(alive[STEPS - 1])}"
    grown = max(resident.values()) - resident[WARM]
    assert grown < RSS_BOUND, f"{grown >> 20} MiB more after step {WARM}"
    taken = [s for s in swarm.servers[2] if handed(s, "taken")]
    assert taken, "the hops went through the handover"


def handed(server: object, way: str) -> float:
    metrics = server.servicer.metrics  # type: ignore[attr-defined]
    return float(metrics._handovers.labels(**metrics.values, way=way)._value.get())
