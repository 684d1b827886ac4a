"""An audit of step N that ends after step N committed (issue 69 item 4): an auditor that has
applied N's update re-executes N's microbatch on N's parameters, kept for it
(`stage_server.replica.prior_params`), bitwise what it answered at N; or, where none are kept,
refuses it as stale (no evidence either way). Never on N+1's parameters: that would be a false
disagreement, an honest replica accused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from stage_server.replica.runtime import StageRuntime
from swarm.errors import FailedPrecondition
from swarm.job.config import JobConfig
from swarm.model.data import make_data
from swarm.wire.crossing import Crossing
from tests.support.jobs import make_job


def _job(tmp_path: Path) -> JobConfig:
    return make_job(
        tmp_path,
        training={"stages": 2, "dtype": "float64"},
        runtime={"data_plane": "push"},
        trust={"audit_fraction": 0.5},
    )


def _step(rt: StageRuntime, inputs: torch.Tensor, grad: torch.Tensor) -> None:
    """Microbatch 0 of step `rt.step` at stage 0, accumulated, then the step applied."""
    step = rt.step
    rt.forward(step, 0, Crossing(inputs))
    rt.backward(step, 0, None, grad, need_grad_inputs=False)
    rt.commit(step, [0], int(inputs.shape[0]))


def _redo(rt: StageRuntime, step: int, inputs: torch.Tensor, grad: torch.Tensor) -> Any:
    """A re-execution of microbatch 0 of `step`: its outputs and its gradient's digest."""
    out = rt.forward(step, 0, Crossing(inputs))
    _, receipt = rt.backward(
        step, 0, None, grad, accumulate=False, need_grad_inputs=False, digest_seed=7
    )
    return out, receipt.digest


def test_a_late_reexecution_runs_on_the_parameters_its_step_computed_on(tmp_path: Path) -> None:
    job = _job(tmp_path)
    audited, auditor = StageRuntime(job, 0), StageRuntime(job, 0)  # two replicas of stage 0
    inputs, _ = make_data(job).microbatch(0, 0)
    grad = torch.ones_like(audited.forward(0, 1, Crossing(inputs)))  # its outputs' shape
    with auditor.copies.redoing():  # the honest re-execution, at step 0 (not moved on yet)
        honest = _redo(auditor, 0, inputs, grad)
    auditor.copies.recorded(0)  # a push of step 0 was recorded there: its audit may come late
    _step(auditor, inputs, grad)
    assert auditor.step == 1
    with pytest.raises(FailedPrecondition, match="stale"):  # not a re-execution: refused
        auditor.forward(0, 0, Crossing(inputs))
    with auditor.copies.redoing():
        late = _redo(auditor, 0, inputs, grad)
        assert torch.equal(late[0], honest[0]) and late[1] == honest[1]  # bitwise, on the CPU
        with pytest.raises(FailedPrecondition, match="stale"):  # it never accumulates there
            auditor.backward(0, 0, Crossing(inputs), grad, accumulate=True)
    assert auditor.receipts(0) == {}
    now = auditor.forward(1, 0, Crossing(inputs))  # step 1 computes on the updated parameters
    assert not torch.equal(now, honest[0])


def test_a_reexecution_whose_parameters_are_not_kept_is_refused_as_stale(tmp_path: Path) -> None:
    job = _job(tmp_path)
    auditor = StageRuntime(job, 0)
    inputs, _ = make_data(job).microbatch(0, 0)
    grad = torch.ones_like(auditor.forward(0, 1, Crossing(inputs)))
    _step(auditor, inputs, grad)  # nothing of step 0 recorded here: nothing kept
    with auditor.copies.redoing(), pytest.raises(FailedPrecondition, match="stale"):
        auditor.forward(0, 0, Crossing(inputs))
    auditor.copies.recorded(1)
    _step(auditor, inputs, grad)  # step 1's kept; step 0's is two updates old
    with auditor.copies.redoing(), pytest.raises(FailedPrecondition, match="stale"):
        auditor.forward(0, 0, Crossing(inputs))
    with auditor.copies.redoing():
        auditor.forward(1, 0, Crossing(inputs))  # the step before is
    _step(auditor, inputs, grad)  # nothing of step 2 recorded, but of the step before: kept
    with auditor.copies.redoing():
        auditor.forward(2, 0, Crossing(inputs))
    _step(auditor, inputs, grad)  # nothing of steps 2 and 3 recorded: the copy let go
    assert auditor.copies._copy is None
    with auditor.copies.redoing(), pytest.raises(FailedPrecondition, match="stale"):
        auditor.forward(3, 0, Crossing(inputs))


def test_a_replica_that_served_none_of_its_pools_step_keeps_it_for_the_late_audits(
    tmp_path: Path,
) -> None:
    # tests/test_audits.py's honest job failed about one run in three: an auditor the routes
    # sent no microbatch of step 0 recorded no push of it, so it kept no parameters of step 0
    # and refused the late audit of another replica's step-0 work as stale: honest work left
    # unjudged. A PREPARE whose group holds a second replica says such an audit may come
    # (`stage_server.replica.commit`); where the job audits nothing, it keeps nothing.
    job = _job(tmp_path)
    auditor = StageRuntime(job, 0)
    inputs, _ = make_data(job).microbatch(0, 0)
    grad = torch.ones_like(auditor.forward(0, 1, Crossing(inputs)))
    with auditor.copies.redoing():  # what an honest step-0 re-execution answers
        honest = _redo(auditor, 0, inputs, grad)
    auditor.copies.pooled(0)  # averaged with another replica; none of its pushes here
    auditor.commit(0, [], 8)  # its part: zeros; the pool's 8 samples
    assert auditor.step == 1
    with auditor.copies.redoing():
        late = _redo(auditor, 0, inputs, grad)
    assert torch.equal(late[0], honest[0]) and late[1] == honest[1]

    unaudited = StageRuntime(
        make_job(tmp_path, training={"stages": 2}, trust={"audit_fraction": 0.0}), 0
    )
    unaudited.copies.pooled(0)
    unaudited.commit(0, [], 8)
    assert unaudited.copies._copy is None  # audits off: nothing paid (issue 69 item 2)
