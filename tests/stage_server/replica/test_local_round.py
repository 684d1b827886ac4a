"""`pool.mode = "local"` on a replica, without networking: local steps over its own samples, a
round's end (pseudo-gradients summed by hand, as averaging would), its state, and what it refuses.
Through real processes: tests/system/test_local_steps.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from stage_server.replica.following import Began
from stage_server.replica.runtime import StageRuntime
from swarm.errors import ConfigError, FailedPrecondition, InvalidArgument
from swarm.job.config import JobConfig
from swarm.job.rule import EagerOp
from swarm.model.data import make_data
from swarm.model.local_steps import train_replicas
from swarm.model.outer_rules import ordered_sum
from swarm.model.reference import train_local
from swarm.model.routes import Join, Record, Run, StepRuns, Sync
from swarm.proto import stage_pb2 as pb
from swarm.wire.crossing import Crossing
from tests.support.equality import assert_states_within
from tests.support.jobs import make_job

LOCAL = {"mode": "local", "sync_every": 2}
RELAY = {"data_plane": "relay"}


def _job(tmp_path: Path, **training: object) -> JobConfig:
    table = {"stages": 1, "steps": 3, "target_batch_size": 16, "checkpoint_every": 0}
    return make_job(tmp_path, training=table | training, pool=LOCAL, runtime=RELAY)


def _train(rt: StageRuntime, job: JobConfig, step: int, indices: list[int]) -> int:
    data = make_data(job)
    for index in indices:
        inputs, targets = data.microbatch(step, index)
        rt.forward_backward(step, index, Crossing(inputs), targets)
    samples = len(indices) * job.training.microbatch_size
    rt.prepare(step, indices, samples)
    rt.set_prepared(step, rt.sums.accum_or_zeros(step), samples)
    assert rt.prepared_sq_norm(step) >= 0  # as the committer asks, whatever the samples
    rt.apply(step)
    return samples


def _end_round(pool: list[StageRuntime], boundary: int) -> None:
    parts = [rt.round.prepare(boundary) for rt in pool]
    total = sum(rt.round.samples for rt in pool if rt.round is not None)
    for rt in pool:
        summed = [sum(p[j] for p in parts[1:]) + parts[0][j] for j in range(len(parts[0]))]
        rt.round.set_prepared(boundary, [t.clone() for t in summed], total)
        assert not rt.round.apply(boundary)
        assert rt.round.apply(boundary)  # a retry changes nothing


def test_a_pool_of_two_with_local_steps_equals_the_reference_replaying_its_routes(
    tmp_path: Path,
) -> None:
    """Replica a takes microbatches 0-2 of step 0 and 0 of step 1, b the rest (and none of step 2,
    whose local step moves nothing there); rounds end after steps 1 and 2."""
    job = _job(tmp_path)
    a, b = StageRuntime(job, 0), StageRuntime(job, 0)
    held = {0: ([0, 1, 2], [3]), 1: ([0], [1, 2, 3]), 2: ([0, 1, 2, 3], [])}
    record: list[object] = [Join(0, 0, "a", None), Join(0, 0, "b", None)]
    for step, (mine, theirs) in held.items():
        _train(a, job, step, mine)
        _train(b, job, step, theirs)
        runs = [Run(i, (0,), ("a",)) for i in mine] + [Run(i, (0,), ("b",)) for i in theirs]
        record.append(StepRuns(step, tuple(sorted(runs, key=lambda r: r.index))))
        if step in (1, 2):
            _end_round([a, b], step + 1)
            record += [Sync(step, 0, ("a", "b"))]
    assert b.step == 3 and b.round is not None and b.round.synced == 3
    expected = train_replicas(job, routes=record).state_dict()  # type: ignore[arg-type]
    assert_states_within(a.state_dict(), expected, tol=1e-12)
    assert_states_within(b.state_dict(), expected, tol=1e-12)


def test_the_round_travels_with_the_state(tmp_path: Path) -> None:
    job = _job(tmp_path)
    a = StageRuntime(job, 0)
    _train(a, job, 0, [0, 1])
    _train(a, job, 1, [2])
    _end_round([a], 2)
    _train(a, job, 2, [0])
    state = a.export_state()
    assert any(k.startswith("round/") for k in state) and any(k.startswith("outer/") for k in state)
    for name, tensor in state.items():
        a.checks.state_tensor(name, tensor)  # a job in local mode accepts its own state
    b = StageRuntime(job, 0)
    b.load_state(3, state)
    assert b.round is not None and a.round is not None
    for s, t in zip(b.round.start, a.round.start, strict=True):
        assert torch.equal(s, t)
    assert b.round.synced == a.round.synced == 2


def _follow(follower: StageRuntime, source: StageRuntime) -> None:
    for u in source.updates.since("b", follower.step):  # as `stage_server.replica.copying` asks
        follower.follow.apply(u)


@pytest.mark.parametrize("taken", ["mid-round", "before-the-round-end"])
def test_a_copy_follows_its_source_through_a_rounds_end(tmp_path: Path, taken: str) -> None:
    """A joiner copies a member mid-round (or between the round's last local step and its end)
    and follows its updates, the round's end among them: at the next round's start it is the
    member bit for bit, inner optimizer state included, and only then a whole copy."""
    job = _job(tmp_path, steps=6)
    a, other = StageRuntime(job, 0), StageRuntime(job, 0)
    _train(a, job, 0, [0, 1])
    _train(other, job, 0, [2, 3])
    if taken == "before-the-round-end":
        _train(a, job, 1, [0])
        _train(other, job, 1, [1, 2, 3])
    a.updates.follow("b", a.step)
    b = StageRuntime(job, 0)
    b.follow.load(a.step, a.export_state(), began=Began(0, 0))  # a fresh replica
    assert b.copy_step == 1  # mid-round at 1, or at 2 without the round's end
    if taken == "mid-round":
        _train(a, job, 1, [0])
        _train(other, job, 1, [1, 2, 3])
        _follow(b, a)
        assert b.step == 2 and b.copy_step == 1  # the round's end is not in yet
    _end_round([a, other], 2)
    _follow(b, a)
    assert b.step == b.copy_step == 2
    for p, q in zip(a.params, b.params, strict=True):
        assert torch.equal(p, q)
    assert str(a.optimizer.state_dict()) == str(b.optimizer.state_dict())
    # Both go on as members: the same microbatches give the same bits.
    _train(a, job, 2, [0, 1])
    _train(b, job, 2, [0, 1])
    for p, q in zip(a.params, b.params, strict=True):
        assert torch.equal(p, q)


def test_rounds_end_where_the_job_says_and_nowhere_else(tmp_path: Path) -> None:
    job = _job(tmp_path)
    a = StageRuntime(job, 0)
    _train(a, job, 0, [0])
    with pytest.raises(FailedPrecondition, match="no round of it ends at 1"):
        a.round.prepare(1)
    with pytest.raises(InvalidArgument, match="total_samples must be positive"):
        a.prepare(1, [], -1)
    step_mode = make_job(tmp_path, "step", training={"stages": 1, "steps": 3})
    with pytest.raises(FailedPrecondition, match=r'pool\.mode = "local"'):
        StageRuntime(step_mode, 0).round.prepare(2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"training": {"delayed_update": True}}, "training.delayed_update"),
        ({"training": {"grad_clip": 1.0}}, "training.grad_clip"),
        ({"training": {"checkpoint_every": 3}}, "training.checkpoint_every"),
        ({"training": {"eval_every": 5}}, "training.eval_every"),
        # eager needs local mode (or delayed_update, which the swarm refuses so far:
        # tests/swarm/model/test_local_steps.py)
        ({"pool": {"mode": "step", "overlap": "eager"}}, "pool.overlap"),
    ],
)
def test_what_local_steps_cannot_do_is_said_when_the_job_is_read(
    tmp_path: Path, overrides: dict[str, dict[str, object]], message: str
) -> None:
    sections = {"pool": dict(LOCAL), "runtime": dict(RELAY), "training": {"checkpoint_every": 0}}
    for section, table in overrides.items():
        sections.setdefault(section, {}).update(table)
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        make_job(tmp_path, **sections)


# -- pool.overlap = "eager" ---------------------------------------------------------------------
EAGER = LOCAL | {"overlap": "eager"}


def _eager_job(tmp_path: Path, steps: int = 5) -> JobConfig:
    table = {"stages": 1, "steps": steps, "target_batch_size": 16, "checkpoint_every": 0}
    return make_job(tmp_path, "eager", training=table, pool=EAGER, runtime=RELAY)


def _total(pool: list[StageRuntime]) -> int:
    return sum(rt.round.samples for rt in pool if rt.round is not None)


def _sum(
    pool: list[StageRuntime], part: Callable[[StageRuntime], list[torch.Tensor]]
) -> list[torch.Tensor]:
    """What the pool's averaging gives every member: the parts summed in the group's order."""
    return ordered_sum([part(rt) for rt in pool])


def _eager_last(pool: list[StageRuntime], boundary: int) -> None:
    """The job's last round: the whole sum of the fresh shares, the outer steps, the mean."""
    total = _total(pool)
    summed = _sum(pool, lambda rt: rt.round.last_part(boundary, total))
    for rt in pool:
        rt.round.set_last(boundary, [t.clone() for t in summed], total)
    for rt in pool:
        assert rt.round.last_step(boundary) is False
        assert rt.round.last_step(boundary) is True  # a retry changes nothing
    starts = _sum(pool, lambda rt: rt.round.mean_part(boundary))
    for rt in pool:
        rt.round.set_mean([t.clone() for t in starts], len(pool))


def test_the_eager_operations_are_the_wires() -> None:
    assert {e.name: e.value for e in EagerOp} == {
        n.removeprefix("EAGER_"): v for n, v in pb.EagerOp.items()
    }


def test_an_eager_pool_of_two_equals_the_reference_and_a_copy_follows_it(tmp_path: Path) -> None:
    """Replicas a and b take their outer steps at each round's end before the pool's sum of
    the round's shares arrives (it comes during the next round), the last round is waited for
    and the model is their mean: the reference replaying the routes ends with the same bits.
    A third replica copies a in the middle of round [2, 3] and follows its updates (its outer
    step, the sum arriving later): it is a, bit for bit, its own state included."""
    job = _eager_job(tmp_path)
    a, b = StageRuntime(job, 0), StageRuntime(job, 0)
    held = {
        0: ([0, 1, 2], [3]),
        1: ([0], [1, 2, 3]),
        2: ([0, 1], [2, 3]),
        3: ([3], [0, 1, 2]),
        4: ([0, 1, 2, 3], []),
    }
    record: list[Record] = [Join(0, 0, "a", None), Join(0, 0, "b", None)]
    copy = StageRuntime(job, 0)
    for step, (mine, theirs) in held.items():
        if step == 3:  # mid-round, with the sum of round [0, 1] already in
            a.updates.follow("b", a.step)
            copy.follow.load(a.step, a.export_state(), began=Began(0, 0))  # a fresh replica
            assert copy.round is not None and not copy.round.pending
        _train(a, job, step, mine)
        _train(b, job, step, theirs)
        if step >= 3:
            _follow(copy, a)
        runs = [Run(i, (0,), ("a",)) for i in mine] + [Run(i, (0,), ("b",)) for i in theirs]
        record.append(StepRuns(step, tuple(sorted(runs, key=lambda r: r.index))))
        if step in (1, 3):
            total = _total([a, b])
            for rt in (a, b):
                rt.round.eager_step(step + 1, total)
            if step == 3:
                _follow(copy, a)
                assert copy.copy_step == 3  # the sum of round [2, 3] is not in yet
            summed = ordered_sum([a.round.eager_part(step + 1), b.round.eager_part(step + 1)])
            for rt in (a, b):
                rt.round.set_average(step + 1, [t.clone() for t in summed])
            record.append(Sync(step, 0, ("a", "b")))
            if step == 3:
                _follow(copy, a)
                assert copy.copy_step == 4
                for name, t in a.export_state().items():
                    assert torch.equal(t, copy.export_state()[name]), name
        if step == 4:
            _eager_last([a, b], 5)
            record.append(Sync(step, 0, ("a", "b")))
    expected = train_replicas(job, routes=record).state_dict()  # type: ignore[arg-type]
    assert_states_within(a.state_dict(), expected, tol=0.0)
    assert_states_within(b.state_dict(), expected, tol=0.0)
    plain = make_job(
        tmp_path,
        "plain",
        training={"stages": 1, "steps": 5, "target_batch_size": 16, "checkpoint_every": 0},
        pool=LOCAL,
        runtime=RELAY,
    )
    other = train_replicas(plain, routes=record).state_dict()  # type: ignore[arg-type]
    assert max((a.state_dict()[k] - v).abs().max().item() for k, v in other.items()) > 1e-6


def test_delayed_eager_pool_of_two_equals_the_reference_and_a_copy_follows_it(
    tmp_path: Path,
) -> None:
    """delayed_update's eager rule (rounds of one step): each step's APPLY only keeps the
    replica's sums; its end applies the job's optimizer to the last step's average plus the
    replica's fresh share minus its last share, before this step's sum arrives. The reference
    replaying the routes ends with the same bits, and differs from the naive delayed rule. A
    copy of a taken between a step's APPLY and its end follows it to the same bits."""
    table = {"stages": 1, "steps": 4, "target_batch_size": 16, "checkpoint_every": 0}
    table |= {"delayed_update": True}
    job = make_job(tmp_path, "de", training=table, pool={"overlap": "eager"}, runtime=RELAY)
    a, b, copy = StageRuntime(job, 0), StageRuntime(job, 0), StageRuntime(job, 0)
    assert not a.rule.delays and a.round is not None and a.rule.step_eager
    held = {0: ([0, 1, 2], [3]), 1: ([0], [1, 2, 3]), 2: ([0, 1, 2, 3], []), 3: ([3], [0, 1, 2])}
    record: list[Record] = [Join(0, 0, "a", None), Join(0, 0, "b", None)]
    for step, (mine, theirs) in held.items():
        _train(a, job, step, mine)
        _train(b, job, step, theirs)
        if step == 2:  # between a's APPLY (its sums kept) and the step's end
            a.updates.follow("b", a.step)
            copy.follow.load(a.step, a.export_state(), began=Began(0, 0))  # a fresh replica
            assert copy.copy_step == 2
        runs = [Run(i, (0,), ("a",)) for i in mine] + [Run(i, (0,), ("b",)) for i in theirs]
        record.append(StepRuns(step, tuple(sorted(runs, key=lambda r: r.index))))
        record.append(Sync(step, 0, ("a", "b")))
        if step == 3:
            _eager_last([a, b], 4)
            continue
        total = _total([a, b])
        for rt in (a, b):
            assert rt.round.eager_step(step + 1, total) is False
        summed = ordered_sum([a.round.eager_part(step + 1), b.round.eager_part(step + 1)])
        for rt in (a, b):
            rt.round.set_average(step + 1, [t.clone() for t in summed])
        if step == 2:
            _follow(copy, a)
            assert copy.copy_step == 3
            for name, t in a.export_state().items():
                assert torch.equal(t, copy.export_state()[name]), name
    expected = train_replicas(job, routes=record).state_dict()  # type: ignore[arg-type]
    assert_states_within(a.state_dict(), expected, tol=0.0)
    assert_states_within(b.state_dict(), expected, tol=0.0)
    naive = make_job(tmp_path, "naive", training=table, runtime=RELAY)
    other = train_local(naive).state_dict()
    assert max((a.state_dict()[k] - v).abs().max().item() for k, v in other.items()) > 1e-6


def test_the_eager_round_travels_with_the_state_and_refuses_what_is_not_due(
    tmp_path: Path,
) -> None:
    job = _eager_job(tmp_path)
    a, b = StageRuntime(job, 0), StageRuntime(job, 0)
    _train(a, job, 0, [0, 1])
    _train(b, job, 0, [2, 3])
    with pytest.raises(FailedPrecondition, match="no share of the round ending at step 2"):
        a.round.eager_part(2)
    _train(a, job, 1, [0])
    _train(b, job, 1, [1])
    for rt in (a, b):
        rt.round.eager_step(2, _total([a, b]))
    state = a.export_state()  # its share of round [0, 1] taken, the sum not in yet
    assert {"round/shared", "round/averaged"} <= set(state)
    assert any(k.startswith("share/") for k in state)
    assert not any(k.startswith("average/") for k in state)
    for name, tensor in state.items():
        a.checks.state_tensor(name, tensor)  # an eager job accepts its own state
    _train(a, job, 2, [0])
    _train(a, job, 3, [1])
    with pytest.raises(FailedPrecondition, match="has not arrived"):
        a.round.eager_step(4, 8)  # the next round's end waits for the sum of this one
    c = StageRuntime(job, 0)
    c.load_state(2, state)
    assert c.round is not None and c.round.pending and c.copy_step == 1
    summed = _sum([a, b], lambda rt: rt.round.eager_part(2))
    a.round.set_average(2, summed)
    before = {k: v.clone() for k, v in c.export_state().items()}
    with pytest.raises(InvalidArgument, match="without all average/"):
        c.load_state(2, _without_average(a))  # a state that says it holds the sum, but not all
    after = c.export_state()  # refused before anything of it is loaded: c as it was
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    plain = StageRuntime(
        make_job(
            tmp_path,
            "plain",
            training={"stages": 1, "steps": 5, "target_batch_size": 16, "checkpoint_every": 0},
            pool=LOCAL,
            runtime=RELAY,
        ),
        0,
    )
    with pytest.raises(InvalidArgument):
        plain.checks.state_tensor("round/shared", torch.tensor([2]))  # not an eager job's
    for refused in (
        lambda: plain.round.eager_part(2),
        lambda: plain.round.eager_step(2, 8),  # a plain local job's round is not eager's
        lambda: plain.round.last_part(2, 8),
        lambda: plain.round.last_step(2),
    ):
        with pytest.raises(FailedPrecondition, match=r'pool\.overlap = "eager"'):
            refused()


def _without_average(rt: StageRuntime) -> dict[str, torch.Tensor]:
    state = rt.export_state()
    dropped = next(k for k in state if k.startswith("average/"))
    return {k: v for k, v in state.items() if k != dropped}
