"""A step whose averaged gradient is NaN or infinite at some stage is never applied: the
coordinator sends no APPLY, the job fails naming the step and the stage, the metric counts it,
and the last checkpoint (finite) stays the one to roll back to. Where only some members of a
stage say so, beside finite ones, it is their own word (`scheduler.coordinator.nonfinite`):
they are left out, and the job goes on."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from scheduler.coordinator.commit import NonFiniteStep
from scheduler.coordinator.metrics import CoordinatorFamilies, CoordinatorMetrics
from scheduler.coordinator.trust.own_norms import OwnWords, contradicted, own_lies
from scheduler.coordinator.trust.sum_checks import Checksums
from swarm.errors import NonFiniteGradient, PeerUnavailable, SwarmError
from swarm.job.fingerprint import fingerprint
from swarm.model import checkpoint
from swarm.proto import stage_pb2 as pb
from tests.support.coordinator import Harness, MakeHarness, job_of, until
from tests.support.replicas import FakeReplica, FakeSwarm

pytestmark = pytest.mark.timeout(60)

_COUNTER = "swarm_coordinator_nonfinite_gradients_total"


@pytest.mark.parametrize(
    ("peer", "stage", "norm", "grad_clip"),
    [
        ("c", 1, math.nan, 1.0),  # before: APPLY went out everywhere with scale 1.0
        ("c", 1, math.inf, 1.0),  # before: APPLY with scale 0.0 (refused: the step stalled)
        ("c", 1, math.nan, 0.0),  # no clipping: the norm still counts
    ],
)
async def test_a_non_finite_norm_applies_nothing_and_fails_the_job(
    tmp_path: Path,
    make_harness: MakeHarness,
    peer: str,
    stage: int,
    norm: float,
    grad_clip: float,
) -> None:
    job = job_of(tmp_path, grad_clip=grad_clip, checkpoint_every=1)
    swarm = FakeSwarm(fingerprint(job), 2)
    a, b, c = swarm.add(0, "a"), swarm.add(0, "b"), swarm.add(1, "c")
    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(swarm.job_id, families=CoordinatorFamilies(registry))
    ckpt = tmp_path / "ckpt"
    h = make_harness(job, swarm, metrics=metrics, checkpoint_dir=ckpt)
    await h.coordinator.start()
    await h.step()  # step 0 commits; the checkpoint of step 1 is sealed
    assert checkpoint.latest(ckpt) == 1

    swarm[peer].sq_norm = norm
    tasks = await h.lease()
    await h.run(tasks[0], {0: "a"})
    await h.run(tasks[1], {0: "b"})
    await until(lambda: h.coordinator.finished.is_set() or not h.steps.empty())

    applied = [(r.peer, r.called("apply")) for r in (a, b, c)]
    assert applied == [("a", [0]), ("b", [0]), ("c", [0])]  # step 0's only: no APPLY of step 1
    assert h.steps.empty() and (a.step, b.step, c.step) == (1, 1, 1)
    error = h.coordinator.error
    assert isinstance(error, NonFiniteStep), error
    # Not a SwarmError: the scheduler retries those, and the same microbatches on the same
    # parameters give the same gradient again.
    assert not isinstance(error, SwarmError)
    assert f"step 1: the averaged gradient of stage {stage} is NaN or infinite" in str(error)
    assert f"{peer}: {norm}" in str(error) and "checkpoint of step 1" in str(error)
    with pytest.raises(NonFiniteStep):
        await h.coordinator.lease("t", 1)
    value = registry.get_sample_value(_COUNTER, {"job": swarm.job_id, "stage": str(stage)})
    assert value == 1.0
    await h.coordinator.flush()
    assert checkpoint.latest(ckpt) == 1


async def test_a_replica_that_refuses_to_apply_a_non_finite_gradient_fails_the_job(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    """Every norm PREPARE answered was finite, yet a replica refuses its APPLY (its prepared sums
    are not): the coordinator fails the job rather than go on without that stage's update."""
    job = job_of(tmp_path)
    swarm = FakeSwarm(fingerprint(job), 2)
    swarm.add(0, "a"), swarm.add(1, "c")
    swarm["c"].fail("apply", NonFiniteGradient("stage 1 step 0: the prepared gradient is NaN"))
    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(swarm.job_id, families=CoordinatorFamilies(registry))
    h = make_harness(job, swarm, metrics=metrics)
    await h.coordinator.start()
    for task in await h.lease():
        await h.run(task)
    await asyncio.wait_for(h.coordinator.finished.wait(), 10)
    error = h.coordinator.error
    assert isinstance(error, NonFiniteStep), error
    assert "step 0" in str(error) and "stage 1" in str(error) and "c:" in str(error)
    assert h.steps.empty()
    assert registry.get_sample_value(_COUNTER, {"job": swarm.job_id, "stage": "1"}) == 1.0


async def _pool_of(
    tmp_path: Path, make_harness: MakeHarness, stage0: tuple[str, ...], **training: float
) -> tuple[Harness, dict[str, FakeReplica]]:
    """A started coordinator over stage 0's pool (`stage0`: its peers, the third and later
    added after stage 1's) and stage 1's one replica (c)."""
    job = job_of(tmp_path, **training)
    swarm = FakeSwarm(fingerprint(job), 2)
    replicas = {peer: swarm.add(0, peer) for peer in stage0[:2]}
    replicas["c"] = swarm.add(1, "c")
    replicas.update({peer: swarm.add(0, peer) for peer in stage0[2:]})
    h = make_harness(job, swarm)
    await h.coordinator.start()
    return h, replicas


async def _pool_of_three(
    tmp_path: Path, make_harness: MakeHarness, **training: float
) -> tuple[Harness, tuple[FakeReplica, ...]]:
    """Stage 0's pool of three (a, b, d) and stage 1's one replica (c): `_pool_of`."""
    h, r = await _pool_of(tmp_path, make_harness, ("a", "b", "d"), **training)
    return h, (r["a"], r["b"], r["c"], r["d"])


async def _each_lands_on(h: Harness, peers: list[str]) -> None:
    """The step's microbatches, one on each of `peers` at stage 0 (the rest on the first)."""
    for i, task in enumerate(await h.lease()):
        await h.run(task, {0: peers[min(i, len(peers) - 1)]})


@pytest.mark.attack("nan-contribution")
async def test_one_members_nan_norm_beside_its_pools_finite_ones_leaves_it_out(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    """A pool averages one sum: a member alone answering its norm NaN (a faulty device, or a
    hostile volunteer's PREPARE) while the rest of its pool, a majority, answer one finite norm
    is left out and its microbatches replayed by the others. Before, the job failed
    (`NonFiniteStep`): one replica ended another submitter's job."""
    h, (a, b, c, d) = await _pool_of_three(tmp_path, make_harness, grad_clip=1.0)
    b.sq_norm = math.nan
    await _each_lands_on(h, ["a", "b", "d"])
    record = await h.replayed({0: "a"})  # b's microbatch, replayed on a
    assert record.step == 0
    assert [r.called("apply") for r in (a, c, d)] == [[0], [0], [0]] and b.called("apply") == []
    assert b.called("discard") == [0]  # its gradients voided, replayed on a


@pytest.mark.attack("nan-contribution")
async def test_one_finite_norm_among_its_pools_nans_leaves_no_honest_member_out(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    """The pool's average is NaN (a hostile member's own NaN contribution, or the model), and
    one member answers a finite norm all the same: not a majority, so no one is left out on it
    (the honest members would be, and that member the stage's pool of one); the job fails as it
    always did, naming them."""
    h, (a, _, _, d) = await _pool_of_three(tmp_path, make_harness)
    a.sq_norm = d.sq_norm = math.nan
    await _each_lands_on(h, ["a", "b", "d"])
    await until(lambda: h.coordinator.finished.is_set())
    error = h.coordinator.error
    assert isinstance(error, NonFiniteStep), error
    assert "a: nan" in str(error) and "d: nan" in str(error), error
    assert a.called("discard") == [] and d.called("discard") == []


@pytest.mark.attack("nan-contribution")
async def test_one_member_refusing_its_apply_beside_its_pools_others_is_dropped(
    tmp_path: Path, make_harness: MakeHarness, caplog: pytest.LogCaptureFixture
) -> None:
    """The rest of its pool, a majority, applied the step: it is dropped (a step behind, it
    rejoins by copying one of them), and the job goes on. Before, the job failed."""
    h, (a, b, c, d) = await _pool_of_three(tmp_path, make_harness)
    b.fail("apply", NonFiniteGradient("stage 0 step 0: the prepared gradient is NaN"))
    await _each_lands_on(h, ["a", "b", "d"])
    await until(lambda: not h.steps.empty() or h.coordinator.error is not None)
    assert h.coordinator.error is None, h.coordinator.error
    assert [r.called("apply") for r in (a, c, d)] == [[0], [0], [0]]
    said = "b refused its APPLY as NaN or infinite"
    assert any(said in r.getMessage() and "dropped" in r.getMessage() for r in caplog.records)


async def test_a_refusal_beside_one_that_applied_is_dropped_whatever_the_others_did(
    tmp_path: Path, make_harness: MakeHarness, caplog: pytest.LogCaptureFixture
) -> None:
    """An APPLY that failed otherwise applied nothing, and counts for no side: one applied, one
    refused as NaN, one gone. The refusal is against its own finite PREPARE norm: dropped (it
    rejoins by copying a); the gone one is left behind a step as any lost APPLY's replica is.
    Before, no majority had applied, and the job failed."""
    h, (a, b, c, d) = await _pool_of_three(tmp_path, make_harness)
    b.fail("apply", NonFiniteGradient("stage 0 step 0: the prepared gradient is NaN"))
    d.fail("apply", PeerUnavailable("UNAVAILABLE: connection refused"))
    await _each_lands_on(h, ["a", "b", "d"])
    await _went_on_without_b(h, (a, c), caplog)


@pytest.mark.attack("nan-norm")
async def test_in_a_pool_of_two_a_member_refusing_its_apply_is_dropped(
    tmp_path: Path, make_harness: MakeHarness, caplog: pytest.LogCaptureFixture
) -> None:
    """A hostile member answers PREPARE a finite norm, then refuses its APPLY as NaN: one
    applied and one refused is no majority, and before, the job failed. Its refusal is against
    its own PREPARE: dropped, and the job goes on with the one that applied."""
    h, r = await _pool_of(tmp_path, make_harness, ("a", "b"))
    a, b, c = r["a"], r["b"], r["c"]
    b.fail("apply", NonFiniteGradient("stage 0 step 0: the prepared gradient is NaN"))
    await _each_lands_on(h, ["a", "b"])
    await _went_on_without_b(h, (a, c), caplog)


async def _went_on_without_b(
    h: Harness, applied: tuple[FakeReplica, ...], caplog: pytest.LogCaptureFixture
) -> None:
    """Step 0 committed on `applied`, b dropped for refusing its APPLY (it may rejoin at once,
    by copying one that applied: the fake's copy is instant)."""
    await until(lambda: not h.steps.empty() or h.coordinator.error is not None)
    assert h.coordinator.error is None, h.coordinator.error
    assert [r.called("apply") for r in applied] == [[0]] * len(applied)
    said = "b refused its APPLY as NaN or infinite (stage 0 step 0: the prepared gradient"
    assert any(said in r.getMessage() and "dropped" in r.getMessage() for r in caplog.records)


@pytest.mark.attack("nan-norm")
def test_a_member_that_withholds_its_reports_has_its_nan_read_as_its_own() -> None:
    """Asked for checks, it reports none of a part its pool's other member reported: it would
    answer nothing to be read by, and a pool of two has no majority (`own_lies`)."""
    honest = _words((0, 0.5, 2.0), (1, -0.25, 3.0))
    withheld = {(0, "a"): honest, (0, "b"): _words((0, 0.5, 2.0))}
    assert own_lies([(0, "a", 0.3), (0, "b", math.nan)], withheld) == {(0, "b")}
    silent = {(0, "a"): honest, (0, "b"): _words()}
    assert own_lies([(0, "a", 0.3), (0, "b", math.nan)], silent) == {(0, "b")}
    # the honest one's NaN, with the NaN in its own r·S, is not read so; nor a finite norm
    nan_average = {(0, "a"): _words((0, math.nan, math.nan), (1, 1.0, 3.0)), (0, "b"): honest}
    assert own_lies([(0, "a", math.nan), (0, "b", 0.3)], nan_average) == set()
    # asked for no checks (a pool of one): nothing to read
    assert own_lies([(0, "a", math.nan)], {(0, "a"): OwnWords(None, frozenset())}) == set()


def _words(
    *checks: tuple[int, float, float], parts: frozenset[int] = frozenset({0, 1})
) -> OwnWords:
    """A member's checksums whose reports of each part are `(part, r·S, ‖S‖)`."""
    asked = Checksums(seed=1)
    asked.reports = [pb.SumCheck(part=k, sum_dot=d, sum_norm=n) for k, d, n in checks]
    return OwnWords(asked, parts)


def test_a_non_finite_norm_against_its_own_finite_reports_is_its_own() -> None:
    """A member's own words about the average it took back (r·S and ‖S‖ of every part) say
    whether its NaN or infinite norm of that average can be honest (`contradicted`)."""
    finite = _words((0, 0.5, 2.0), (1, -0.25, 3.0))
    assert contradicted(math.nan, finite)
    assert contradicted(math.inf, finite)
    assert not contradicted(13.0, finite)  # a finite norm is never read so
    # its ‖S‖ NaN while its r·S are finite: no finite sum has one
    assert contradicted(math.inf, _words((0, 0.5, math.nan), (1, 0.1, 3.0)))
    # a NaN or infinity in the average, by its own r·S: the majority rule's to read
    assert not contradicted(math.nan, _words((0, math.nan, math.nan), (1, 0.1, 3.0)))
    assert not contradicted(math.inf, _words((0, math.inf, math.inf), (1, 0.1, 3.0)))
    # an honest overflow: ‖S‖ too large to square within float64 (or infinite)
    assert not contradicted(math.inf, _words((0, 1.0, 1e200), (1, 1.0, 3.0)))
    assert not contradicted(math.inf, _words((0, 1.0, math.inf), (1, 1.0, 3.0)))
    assert contradicted(math.nan, _words((0, 1.0, 1e200), (1, 1.0, 3.0)))  # never NaN
    # not every part's sum reported: nothing to read (a pool of one asks for no checks)
    assert not contradicted(math.nan, _words((0, 0.5, 2.0)))
    assert not contradicted(math.nan, OwnWords(None, frozenset()))
