"""Co-located stage servers hand their boundary tensors over through memory (issue 53, item 2):
real stage-server processes on one host, the push plane, a replica SIGKILLed with a handed-over
microbatch in its hands. The result is `swarm local`'s (float64), the servers' counters show
that hops went through the handover (activations offered and taken, gradients written into
the caller's slot), and nothing is left in /dev/shm. On a CUDA device (the device check runs
the `cuda` case) the same hops go device to device by CUDA IPC."""

from __future__ import annotations

import os
import signal
import urllib.request
from pathlib import Path

import pytest
import torch

from swarm.device.shm_handover import PREFIX, sweep
from swarm.device.site import SHM_DIR
from swarm.ops.faults import Fault, Point
from tests.support.equality import assert_equal_to_local
from tests.support.jobs import write_job
from tests.support.servers import Servers, train_on

pytestmark = pytest.mark.slow

CUDA = pytest.param(
    "cuda",
    marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
)


def handovers(metrics_port: str) -> dict[str, float]:
    """A stage server's `swarm_stage_handovers_total`, by way."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    ways: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("swarm_stage_handovers_total{"):
            way = line.split('way="', 1)[1].split('"', 1)[0]
            ways[way] = ways.get(way, 0.0) + float(line.rsplit(" ", 1)[1])
    return ways


def segments_of(pids: set[int]) -> list[str]:
    """The handover segments in /dev/shm made by one of `pids`."""
    return [n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX) and int(n.split("-")[3]) in pids]


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_colocated_servers_hand_over_through_a_sigkill(tmp_path: Path, device: str) -> None:
    # Stage 1 has two replicas; s1r0 is SIGKILLed as a handed-over push reaches it at step 2
    # (its sender lets the segment go when the call fails, and tries s1r1).
    job = write_job(
        tmp_path, training={"steps": 4, "target_batch_size": 16}, runtime={"data_plane": "push"}
    )
    fault = Fault("s1r0", Point.FORWARD, 2)
    servers = Servers(job, [1, 2, 1, 1], [fault], tmp_path, device=device, metrics=True)
    victim = servers.procs[fault.target]
    pids = {p.proc.pid for p in servers.procs.values()}
    try:
        state, _ = train_on(servers)
        counts = {
            name: handovers(p.ready["metrics"])
            for name, p in servers.procs.items()
            if p.proc.poll() is None
        }
    finally:
        servers.stop()
    assert victim.proc.returncode == -signal.SIGKILL, "the fault must have killed the replica"
    # float64: the CPU equals `swarm local` to 1e-9; a GPU's float64 kernels sum in their order
    assert_equal_to_local(job, state, tol=1e-9 if device == "cpu" else 1e-7)
    total = {
        way: sum(c.get(way, 0.0) for c in counts.values()) for way in ("offered", "taken", "filled")
    }
    # Every stage but the last offers its outputs on; every stage after the first takes them;
    # the gradients come back into the callers' slots.
    assert total["offered"] > 0 and total["taken"] > 0 and total["filled"] > 0, counts
    assert counts["s0r0"].get("offered", 0) > 0 and counts["s3r0"].get("taken", 0) > 0, counts
    sweep()  # what the SIGKILLed replica may have left, as any process's next start does
    assert segments_of(pids) == []
