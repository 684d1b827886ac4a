"""The trainer's side of "late receipts are harmless": an accumulating call (Backward, or
ForwardBackward at the last stage) that failed in a way where the replica may have accumulated all
the same (it did not answer, or answered with an error of its own) is not accumulated again at that
stage on another replica: a second receipt there would void the first replica's whole step at that
stage. The trainer goes on without accumulating (a non-accumulating call elsewhere for the input
gradient it still needs) and reports the microbatch without that stage, which the coordinator then
settles exactly (it adopts the late receipt, or replays the stage). A refusal (the replica says it
did not take the call) is retried elsewhere with accumulation, as before; but a push, which passes
its work on before stage 0 may refuse it, may have landed whatever failed it.

Fakes only: the shared fake stage (`tests.support.stages`) behind the trainer's client factory,
and a lease source that records."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from client.trainer import PipelineTrainer
from swarm.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PeerUnavailable,
    RemoteError,
)
from swarm.job.config import JobConfig
from swarm.rpc.lease import Lease, MicrobatchResult, Replica, Task
from tests.support.jobs import make_job
from tests.support.stages import LOSS, Call, FakeCalls

pytestmark = pytest.mark.timeout(30)

LAST = 2  # three stages: 0, 1, 2 (2 computes the loss)
ALL = frozenset(range(LAST + 1))


class Recorder:
    """A `LeaseSource` that records reports and releases (the tests lease nothing)."""

    def __init__(self) -> None:
        self.reports: list[MicrobatchResult] = []
        self.released: list[list[int]] = []

    async def lease(
        self, trainer: str, count: int, *, wait_s: float = 0.0, working: Sequence[object] = ()
    ) -> Lease:
        raise AssertionError("not leased from in these tests")

    async def report(self, trainer: str, result: MicrobatchResult) -> None:
        self.reports.append(result)

    async def report_and_lease(
        self,
        trainer: str,
        results: Sequence[MicrobatchResult],
        count: int,
        *,
        working: Sequence[object],
    ) -> Lease:
        self.reports.extend(results)
        return Lease(0, [], [])  # nothing more: the tests give each task themselves

    async def release(
        self, trainer: str, indices: Sequence[int], failure: str | None = None
    ) -> None:
        self.released.append(list(indices))


def _job(tmp_path: Path, plane: str) -> JobConfig:
    # The relay plane: the trainer's own hops are what these tests drive.
    return make_job(tmp_path, training={"stages": LAST + 1}, runtime={"data_plane": plane})


def _trainer(
    tmp_path: Path, swarm: FakeCalls, pools: list[list[str]], plane: str = "relay"
) -> tuple[PipelineTrainer, Recorder]:
    source = Recorder()
    trainer = PipelineTrainer(
        _job(tmp_path, plane),
        source,
        seed=0,
        client_factory=swarm.factory(),  # type: ignore[arg-type]
    )
    trainer._leased_step = 0
    trainer.sync([[Replica(p, p) for p in pool] for pool in pools])
    return trainer, source


UNCERTAIN = [
    PeerUnavailable("DEADLINE_EXCEEDED: Deadline Exceeded"),
    PeerUnavailable("the connection was closed during the call"),
    RemoteError("INTERNAL: a bug after accumulating", "INTERNAL"),
]


@pytest.mark.parametrize("error", UNCERTAIN, ids=lambda e: type(e).__name__)
async def test_an_uncertain_backward_is_not_accumulated_again_elsewhere(
    tmp_path: Path, error: Exception
) -> None:
    swarm = FakeCalls()
    swarm.fail(1, error, after=True)
    trainer, source = _trainer(tmp_path, swarm, [["a"], ["b1", "b2"], ["c"]])
    try:
        await trainer._run_task(Task(0, 0, ALL))
    finally:
        await trainer.close()
    # One accumulating Backward at stage 1 (it landed; its answer did not), then the input
    # gradient stage 0 needs from the other replica, without accumulating there.
    (first,) = swarm.accumulating(1)
    other = ({"b1", "b2"} - {first.peer}).pop()
    assert swarm.at(1, "backward") == [
        first,
        Call(other, 1, "backward", accumulate=False, need_grad_inputs=True),
    ]
    assert swarm.accumulated[1] == [first.peer]
    # Reported without stage 1: the coordinator adopts first's receipt (or replays stage 1).
    (report,) = source.reports
    assert report.holders == {0: "a", 2: "c"}
    assert report.loss_sum == LOSS and source.released == []


@pytest.mark.parametrize("error", UNCERTAIN, ids=lambda e: type(e).__name__)
async def test_an_uncertain_forward_backward_at_the_last_stage_is_not_accumulated_again(
    tmp_path: Path, error: Exception
) -> None:
    swarm = FakeCalls()
    swarm.fail(LAST, error, after=True)
    trainer, source = _trainer(tmp_path, swarm, [["a"], ["b"], ["c1", "c2"]])
    try:
        await trainer._run_task(Task(0, 0, ALL))
    finally:
        await trainer.close()
    (first,) = swarm.accumulating(LAST)
    other = ({"c1", "c2"} - {first.peer}).pop()
    # ForwardBackward without accumulating gives the loss and the input gradient all the same.
    assert swarm.at(LAST, "forward_backward") == [
        first,
        Call(other, LAST, "forward_backward", accumulate=False, need_grad_inputs=True),
    ]
    (report,) = source.reports
    assert report.holders == {0: "a", 1: "b"}
    assert report.loss_sum == LOSS


async def test_an_uncertain_backward_at_the_lowest_stage_needs_no_other_call(
    tmp_path: Path,
) -> None:
    swarm = FakeCalls()
    swarm.fail(0, PeerUnavailable("DEADLINE_EXCEEDED: Deadline Exceeded"), after=True)
    trainer, source = _trainer(tmp_path, swarm, [["a1", "a2"], ["b"], ["c"]])
    try:
        await trainer._run_task(Task(0, 0, ALL))
    finally:
        await trainer.close()
    # Nothing below stage 0 needs its input gradient: no second call at all.
    assert len(swarm.at(0, "backward")) == 1
    (report,) = source.reports
    assert report.holders == {1: "b", 2: "c"}


async def test_an_uncertain_cached_replay_is_not_accumulated_again(tmp_path: Path) -> None:
    swarm = FakeCalls()
    trainer, source = _trainer(tmp_path, swarm, [["a"], ["b1", "b2"], ["c"]])
    try:
        await trainer._run_task(Task(0, 0, ALL))  # caches the boundary tensors
        swarm.calls.clear()
        swarm.accumulated.clear()
        swarm.fail(1, PeerUnavailable("UNAVAILABLE: connection reset"), after=True)
        await trainer._run_task(Task(0, 0, frozenset({1})))  # stage 1 lost: a replay
    finally:
        await trainer.close()
    assert len(swarm.accumulating(1)) == 1 and len(swarm.calls) == 1
    assert source.reports[-1].holders == {}


@pytest.mark.parametrize(
    "error",
    [
        FailedPrecondition("stage 1 is at step 1, not 0"),
        InvalidArgument("bad shape"),
        NotFound("unknown job"),
    ],
    ids=lambda e: type(e).__name__,
)
async def test_a_failure_that_did_not_accumulate_is_retried_elsewhere_with_accumulation(
    tmp_path: Path, error: Exception
) -> None:
    swarm = FakeCalls()
    swarm.fail(1, error, after=False)
    trainer, source = _trainer(tmp_path, swarm, [["a"], ["b1", "b2"], ["c"]])
    try:
        await trainer._run_task(Task(0, 0, ALL))
    finally:
        await trainer.close()
    first, second = swarm.accumulating(1)
    assert first.peer != second.peer and swarm.accumulated[1] == [second.peer]
    (report,) = source.reports
    assert report.holders == {0: "a", 1: second.peer, 2: "c"}


async def test_a_push_refused_at_stage_0_after_passing_it_on_is_not_pushed_again(
    tmp_path: Path,
) -> None:
    """On the push plane stage 0 passes the microbatch on before its own backward may refuse
    it (a stale epoch; a run it holds the microbatch under already: `StepSums.other_run`), so
    the stages after may hold it whatever the refusal says. Before, the refusal read as "took
    nothing" and the trainer pushed it again, accumulating, through another replica of stage 0:
    every stage after held it twice, and the commit voided each first holder's step there. Now
    any failure of the push may have landed: it is not pushed again, and the microbatch is
    reported without holders for the coordinator to settle (adopt, or replay)."""
    swarm = FakeCalls()
    refused = FailedPrecondition("microbatch 0 is held here under run 5, not run 7")
    swarm.fail(0, refused, after=True)  # the stages after accumulated, then stage 0 refused
    trainer, source = _trainer(tmp_path, swarm, [["a1", "a2"], ["b"], ["c"]], plane="push")
    try:
        await trainer._run_task(Task(0, 0, ALL))
    finally:
        await trainer.close()
    (pushed,) = swarm.accumulating(0)  # one push accumulated, none after it
    assert swarm.accumulated == {k: [pushed.peer] for k in ALL}
    (report,) = source.reports
    assert report.holders == {} and source.released == []
