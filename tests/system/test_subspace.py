"""A subspace-boundary job (`model.boundary_rank`) on real stage-server processes, one of them
killed with SIGKILL: the result must be `swarm local`'s parameters (float64, within 1e-9), on
both data planes. The relay plane's kill at AVERAGING makes the trainer replay from its cached
boundary tensors (coefficients and token ids), the push plane's at FORWARD makes a stage send the
coefficients and token ids on to the survivor."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from swarm.ops.faults import Fault, Point
from tests.support.equality import assert_equal_to_local
from tests.support.jobs import write_job
from tests.support.servers import Servers, counted, train_on


@pytest.mark.parametrize(("plane", "point"), [("relay", Point.AVERAGING), ("push", Point.FORWARD)])
def test_a_subspace_job_stays_exact_through_a_kill(
    tmp_path: Path, plane: str, point: Point
) -> None:
    job = write_job(
        tmp_path,
        model={"boundary_rank": 4},  # d_model 32: 8x fewer values per token each way
        training={"steps": 4, "target_batch_size": 16},
        runtime={"data_plane": plane},
    )
    fault = Fault("s1r0", point, 2)
    servers = Servers(job, [1, 2, 1, 1], [fault], tmp_path, slow=frozenset({"s1r1"}))
    victim = servers.procs[fault.target]
    try:
        state, registry = train_on(servers)
    finally:
        servers.stop()
    assert victim.proc.returncode == -signal.SIGKILL, "the fault must have killed the replica"
    assert_equal_to_local(job, state, tol=1e-9)
    if plane == "relay":  # replayed from the trainer's cached coefficients and token ids
        assert counted(registry, "swarm_trainer_cached_replays_total") >= 1
    else:
        assert counted(registry, "swarm_trainer_unreported_stages_total") >= 1
