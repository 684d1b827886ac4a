"""`training.delayed_update` through real processes: SIGKILLs during the overlapped averaging and
evaluations through a kill, float64 equal to the reference. A recipe through a kill, a rejoin and
a rollback: tests/system/test_faults.py (one case a rule). The rule itself and in-process pools:
tests/stage_server/replica/test_delayed_update.py."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from swarm.ops.faults import Fault, Point
from swarm.ops.progress import StepRecord
from tests.support.equality import assert_equal_to_local, evaluations, local_evaluations
from tests.support.jobs import DELAYED, write_job
from tests.support.servers import Servers, counted, train_on


@pytest.mark.slow
@pytest.mark.parametrize(
    ("data_plane", "stage", "point"),
    [("relay", 1, Point.AVERAGING), ("push", 0, Point.AVERAGING), ("push", 3, Point.BACKWARD)],
)
def test_a_replica_killed_during_the_overlapped_averaging_stays_exact(
    tmp_path: Path, data_plane: str, stage: int, point: Point
) -> None:
    """`s{stage}r0` dies in step 2's averaging, which runs while step 3's microbatches do (or
    at a backward of step 2): it held gradients of both steps. Step 2's are replayed on the
    parameters before step 1's update, step 3's on those after it, and the result is exact."""
    job = write_job(
        tmp_path,
        training={"steps": 6, "target_batch_size": 16, **DELAYED},
        runtime={"data_plane": data_plane},
    )
    layout = [2 if k == stage else 1 for k in range(4)]
    fault = Fault(f"s{stage}r0", point, 2)
    servers = Servers(job, layout, [fault], tmp_path, slow=frozenset({f"s{stage}r1"}))
    victim = servers.procs[fault.target]
    records: list[StepRecord] = []
    try:
        state, registry = train_on(servers, records.append)
    finally:
        servers.stop()
    assert victim.proc.returncode == -signal.SIGKILL, "the fault must have killed the replica"
    assert_equal_to_local(job, state, tol=1e-9)
    assert [r.step for r in records] == list(range(6))
    if point == Point.AVERAGING:
        assert counted(registry, "swarm_coordinator_aborted_rounds_total") >= 1
        assert counted(registry, "swarm_coordinator_replays_total") >= 1


@pytest.mark.slow
def test_evaluations_with_delayed_update_are_of_the_parameters_each_step_computes_on(
    tmp_path: Path,
) -> None:
    """Llama on 4 stages of 2 replicas, evaluated every 3 steps, a replica killed at the first
    forward of step 3: every validation loss equals the reference's (step t's of the parameters
    step t computes on, the final one of the trained parameters)."""
    job = write_job(
        tmp_path,
        model={"kind": "llama", "n_heads": 2, "n_kv_heads": 1},
        training={"steps": 8, "target_batch_size": 16, "eval_every": 3, **DELAYED},
        runtime={"data_plane": "push"},
    )
    servers = Servers(job, [2, 2, 2, 2], [Fault("s2r0", Point.FORWARD, 3)], tmp_path)
    records: list[StepRecord] = []
    try:
        state, _ = train_on(servers, records.append)
    finally:
        servers.stop()
    assert servers.procs["s2r0"].proc.returncode == -signal.SIGKILL
    assert_equal_to_local(job, state, tol=1e-9)
    evals, expected = evaluations(records), local_evaluations(job)
    assert [s for s, _ in evals] == [s for s, _ in expected] == [0, 3, 6, 8]
    for (_, a), (_, b) in zip(evals, expected, strict=True):
        assert a is not None and b is not None and abs(a - b) <= 1e-9 * b
