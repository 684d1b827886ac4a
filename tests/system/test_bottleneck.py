"""A learned-bottleneck job (`model.boundary_bottleneck`) on real stage-server processes, the
stage holding both halves of the bottleneck (an expand and a squeeze) replicated and one of its
replicas killed with SIGKILL at FORWARD on the push plane: the result must be `swarm local`'s
parameters (float64, within 1e-9). The squeeze and expand are ordinary parameters of the stages
at each cut, so averaging, state transfer and the resend after the kill carry them as any other;
the relay plane's replay of the same boundary is tests/system/test_subspace.py's (a narrower
boundary there too, with token ids besides)."""

from __future__ import annotations

import signal
from pathlib import Path

from swarm.ops.faults import Fault, Point
from tests.support.equality import assert_equal_to_local
from tests.support.jobs import write_job
from tests.support.servers import Servers, counted, train_on


def test_a_bottleneck_job_stays_exact_through_a_kill(tmp_path: Path) -> None:
    job = write_job(
        tmp_path,
        model={"boundary_bottleneck": 4},  # d_model 32: 8x fewer values per token each way
        training={"steps": 4, "target_batch_size": 16},
        runtime={"data_plane": "push"},
    )
    fault = Fault("s1r0", Point.FORWARD, 2)
    servers = Servers(job, [1, 2, 1, 1], [fault], tmp_path, slow=frozenset({"s1r1"}))
    victim = servers.procs[fault.target]
    try:
        state, registry = train_on(servers)
    finally:
        servers.stop()
    assert victim.proc.returncode == -signal.SIGKILL, "the fault must have killed the replica"
    assert any(".squeeze." in name for name in state) and any(".expand." in name for name in state)
    assert_equal_to_local(job, state, tol=1e-9)
    assert counted(registry, "swarm_trainer_unreported_stages_total") >= 1
