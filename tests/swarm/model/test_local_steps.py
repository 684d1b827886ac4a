"""`swarm local` for `pool.mode = "local"` (swarm/model/local_steps.py): R replicas of every
stage with local steps and rounds, from a route record or a synthetic one. Where the rule must
collapse to synchronous training it equals `train_local`; elsewhere it is a rule of its own,
bitwise the same for a record however it reaches it (written and read back, or synthetic)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from swarm.cli import main
from swarm.errors import ConfigError
from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.model.data import make_val_data
from swarm.model.local_steps import synthetic_routes, train_replicas
from swarm.model.outer_rules import eager_gradients
from swarm.model.reference import evaluate, train_local
from swarm.model.routes import (
    Join,
    Record,
    Resume,
    Run,
    StepRuns,
    Sync,
    read_routes,
    write_record,
)
from swarm.ops.progress import StepRecord
from tests.support.equality import assert_no_member_skipped_a_round, assert_states_within
from tests.support.jobs import make_job, write_job

RELAY = {"data_plane": "relay"}  # either plane records routes; the reference ignores it


def _job(tmp_path: Path, name: str = "test", **overrides: dict[str, Any]) -> JobConfig:
    pool = {"mode": "local", "sync_every": 4, "outer_lr": 0.7, "outer_momentum": 0.9}
    pool |= overrides.pop("pool", {})
    return make_job(tmp_path, name, pool=pool, runtime=RELAY, **overrides)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _write(path: Path, records: list[Record]) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        write_record(f, records)
    return path


def test_one_replica_with_a_unit_outer_step_is_synchronous_training(tmp_path: Path) -> None:
    # One replica: the pseudo-gradient is its whole round's move, and an outer step of lr 1
    # without momentum lands back on its parameters. 5 steps in rounds of 2: the last round
    # (step 4 alone) is the one that always ends after the last step.
    job = _job(
        tmp_path,
        pool={"sync_every": 2, "outer_lr": 1.0, "outer_momentum": 0.0},
        training={"steps": 5, "eval_every": 2},
    )
    got: list[StepRecord] = []
    want: list[StepRecord] = []
    state = _state(train_replicas(job, replicas=1, on_step=got.append))
    assert_states_within(state, _state(train_local(job, on_step=want.append)), 1e-12)
    assert [(r.step, r.samples) for r in got] == [(r.step, r.samples) for r in want]
    for g, w in zip(got, want, strict=True):
        assert g.loss == pytest.approx(w.loss, abs=1e-12, nan_ok=True)
        assert (g.val_loss is None) == (w.val_loss is None)
        if w.val_loss is not None:
            assert g.val_loss == pytest.approx(w.val_loss, abs=1e-12)
    assert got[-1].final_evaluation and [r.step for r in got if r.val_loss] == [0, 2, 4, 5]


def test_rounds_of_one_sgd_step_are_synchronous_training(tmp_path: Path) -> None:
    # Every round one plain SGD step from shared parameters: the samples-weighted mean of the
    # replicas' moves is lr times the step's whole mean gradient, whichever replica took what.
    job = _job(
        tmp_path,
        pool={"sync_every": 1, "outer_lr": 1.0, "outer_momentum": 0.0},
        optimizer={"kind": "sgd", "lr": 0.5, "weight_decay": 0.0},
        training={"steps": 4},
    )
    want = _state(train_local(job))
    assert_states_within(_state(train_replicas(job, replicas=2)), want, 1e-9)
    # 3 replicas of 4 microbatches take 2, 1 and 1: only weighting by samples gets it right.
    assert_states_within(_state(train_replicas(job, replicas=3)), want, 1e-9)
    # A replayed gradient: microbatch 0's counts at stages 0-1 on its own chain and at 2-3
    # through another one (through r1 at stages 0-1); each sample and loss counts once.
    replays: list[Record] = []
    for r in synthetic_routes(job, 2):
        if isinstance(r, StepRuns):
            first, *rest = r.runs
            lost = Run(first.index, (0, 1), first.chain)
            replay = Run(first.index, (2, 3), ("r1", "r1", *first.chain[2:]))
            r = StepRuns(r.step, (lost, *rest, replay))
        replays.append(r)
    got: list[StepRecord] = []
    losses: list[StepRecord] = []
    train_local(job, on_step=losses.append)
    assert_states_within(
        _state(train_replicas(job, routes=replays, on_step=got.append)), want, 1e-9
    )
    assert [r.samples for r in got] == [16] * 4
    assert [r.loss for r in got] == pytest.approx([r.loss for r in losses], abs=1e-12)


def test_local_steps_are_their_own_rule_and_a_record_replays_bit_for_bit(tmp_path: Path) -> None:
    job = _job(tmp_path, training={"steps": 12})
    losses: list[float] = []
    synthetic = _state(train_replicas(job, replicas=2, on_step=lambda r: losses.append(r.loss)))
    assert _max_diff(synthetic, _state(train_local(job))) > 1e-6
    assert sum(losses[-3:]) < sum(losses[:3])
    records = list(synthetic_routes(job, 2))
    # Chains cross replicas: some run goes through different replicas at different stages.
    runs = [run for r in records if isinstance(r, StepRuns) for run in r.runs]
    assert any(len(set(run.chain)) > 1 for run in runs)
    replayed = train_replicas(job, routes=read_routes(_write(tmp_path / "routes.jsonl", records)))
    assert all(torch.equal(v, synthetic[k]) for k, v in replayed.state_dict().items())
    # Stage 1's first round drops r1 (its samples with it); r1 comes back as a copy of r0.
    dropped: list[Record] = []
    for r in records:
        if isinstance(r, Sync) and r.step == 3 and r.stage == 1:
            dropped += [Sync(3, 1, ("r0",)), Join(4, 1, "r1", "r0")]
        else:
            dropped.append(r)
    state = _state(train_replicas(job, routes=dropped))
    assert _max_diff(state, synthetic) > 1e-6
    assert all(torch.isfinite(v).all() for v in state.values())


def test_a_joining_replica_copies_parameters_and_optimizer_state(tmp_path: Path) -> None:
    # r1 joins stage 0 mid-round as a copy of r0 and takes over r0's runs; r0 is dropped at the
    # round's end (step 3). With
    # an outer step of lr 1 and no momentum that round lands where r0 alone would have, which
    # holds only if the copy carried AdamW's moments and step count along with the parameters.
    job = _job(tmp_path, pool={"outer_lr": 1.0, "outer_momentum": 0.0}, training={"steps": 8})
    alone = list(synthetic_routes(job, 1))
    handed: list[Record] = []
    for r in alone:
        if isinstance(r, StepRuns) and r.step == 2:
            handed.append(Join(2, 0, "r1", "r0"))
        if isinstance(r, StepRuns) and r.step >= 2:
            runs = tuple(Run(u.index, u.stages, ("r1", *u.chain[1:])) for u in r.runs)
            r = StepRuns(r.step, runs)
        if isinstance(r, Sync) and r.stage == 0:
            r = Sync(r.step, 0, ("r1",))
        handed.append(r)
    want = _state(train_replicas(job, routes=alone))
    assert_states_within(_state(train_replicas(job, routes=handed)), want, 1e-12)


# `swarm local`'s default is a thread per core; the suite's torch work runs on one beside the other
# worker (`tests.support.threads`), and the comparisons below are bit for bit with this process's.
ONE_THREAD = ("--threads", "1")


def test_swarm_local_trains_replicas_for_a_local_job(tmp_path: Path) -> None:
    pool = {"mode": "local", "sync_every": 2}
    job_file = write_job(tmp_path, pool=pool, runtime=RELAY, training={"steps": 4})
    out = tmp_path / "ref.pt"
    assert main(["local", str(job_file), "--replicas", "2", "--out", str(out), *ONE_THREAD]) == 0
    state = torch.load(out)
    expected = train_replicas(_job(tmp_path, "again", pool=pool, training={"steps": 4}))
    assert state.keys() == expected.state_dict().keys()
    assert all(torch.equal(v, state[k]) for k, v in expected.state_dict().items())
    three = list(synthetic_routes(_job(tmp_path, "r", pool=pool), 3, 4))
    routes = _write(tmp_path / "r.jsonl", three)
    replayed = tmp_path / "replayed.pt"
    assert (
        main(["local", str(job_file), "--routes", str(routes), "--out", str(replayed), *ONE_THREAD])
        == 0
    )
    assert not all(torch.equal(v, state[k]) for k, v in torch.load(replayed).items())
    # A step-mode job has no replicas to simulate: the flags are refused, not ignored.
    step_job = write_job(tmp_path, "step")
    assert main(["local", str(step_job), "--replicas", "2"]) == 2


def test_a_record_naming_a_peer_that_never_joined_is_refused(tmp_path: Path) -> None:
    job = _job(tmp_path, training={"steps": 2})
    records = list(synthetic_routes(job, 2))
    step = next(i for i, r in enumerate(records) if isinstance(r, StepRuns) and r.step == 1)
    runs = records[step]
    assert isinstance(runs, StepRuns)
    first = runs.runs[0]
    stray = Run(first.index, first.stages, (*first.chain[:2], "ghost", *first.chain[3:]))
    records[step] = StepRuns(1, (stray, *runs.runs[1:]))
    with pytest.raises(ConfigError, match="step 1: peer 'ghost' is not a replica of stage 2"):
        train_replicas(job, routes=records)
    # Out of order, or ending early: named too.
    with pytest.raises(ConfigError, match="step 1's runs where step 0's were due"):
        train_replicas(job, routes=[r for r in records if not isinstance(r, StepRuns) or r.step])
    with pytest.raises(ConfigError, match="holds the runs of 1 steps; the job trains 2"):
        train_replicas(job, routes=[r for r in records if r.step == 0])


def test_the_eager_rule_applies_own_shares_at_once_and_the_others_a_round_late() -> None:
    # Two members, one parameter: round 1's shares 1 and 2, round 2's 4 and 8.
    t = torch.tensor
    first = eager_gradients(None, [[t(1.0)], [t(2.0)]], [None, None])
    assert [g[0].item() for g in first] == [1.0, 2.0]  # its own share only
    second = eager_gradients([t(3.0)], [[t(4.0)], [t(8.0)]], [[t(1.0)], [t(2.0)]])
    assert [g[0].item() for g in second] == [3.0 + 4.0 - 1.0, 3.0 + 8.0 - 2.0]
    last = eager_gradients([t(3.0)], [[t(4.0)], [t(8.0)]], [[t(1.0)], [t(2.0)]], complete=True)
    assert [g[0].item() for g in last] == [3.0 + 12.0 - 1.0, 3.0 + 12.0 - 2.0]
    # Over the three rounds each member applied every average in full: 3 + 12 = 1 + 2 + 12.


def test_eager_with_one_replica_is_the_plain_round(tmp_path: Path) -> None:
    # One member's fresh share is the whole average: nothing arrives late.
    plain = _job(tmp_path, training={"steps": 9})
    eager = _job(tmp_path, "eager", pool={"overlap": "eager"}, training={"steps": 9})
    want = _state(train_replicas(plain, replicas=1))
    assert_states_within(_state(train_replicas(eager, replicas=1)), want, 1e-12)


def test_eager_with_two_replicas_trains_and_differs_from_the_plain_round(tmp_path: Path) -> None:
    plain = _job(tmp_path, training={"steps": 9})
    eager = _job(tmp_path, "eager", pool={"overlap": "eager"}, training={"steps": 9})
    losses: list[float] = []
    state = _state(train_replicas(eager, replicas=2, on_step=lambda r: losses.append(r.loss)))
    assert all(torch.isfinite(v).all() for v in state.values())
    assert losses[-1] < losses[0]
    assert _max_diff(state, _state(train_replicas(plain, replicas=2))) > 1e-6


def test_the_eager_overlap_is_refused_where_it_does_not_apply(tmp_path: Path) -> None:
    from scheduler.coordinator import LocalCoordinator

    LocalCoordinator(_job(tmp_path, pool={"overlap": "eager"}), "job", lambda: [])  # runs it
    with pytest.raises(ConfigError, match='eager needs "local"'):
        make_job(tmp_path, "step", pool={"overlap": "eager"})
    with pytest.raises(ConfigError, match=r"training\.eval_every.*share no parameters"):
        _job(tmp_path, "ev", pool={"overlap": "eager"}, training={"eval_every": 4})


# -- delayed_update's eager rule (pool.mode = "step", overlap = "eager") -------------------------
def _delayed(tmp_path: Path, name: str, eager: bool, steps: int = 6) -> JobConfig:
    return make_job(
        tmp_path,
        name,
        pool={"overlap": "eager" if eager else "none"},
        training={"steps": steps, "delayed_update": True},
        runtime=RELAY,
    )


def test_delayed_eager_with_one_replica_is_synchronous_training(tmp_path: Path) -> None:
    # One replica's fresh share is the whole average: nothing is late, nothing is stale.
    eager = _delayed(tmp_path, "eager", True)
    sync = make_job(tmp_path, "sync", training={"steps": 6})
    got: list[StepRecord] = []
    state = _state(train_replicas(eager, replicas=1, on_step=got.append))
    assert_states_within(state, _state(train_local(sync)), 1e-12)
    assert [r.step for r in got] == list(range(6))
    syncs = [(r.step, r.stage) for r in synthetic_routes(eager, 2) if isinstance(r, Sync)]
    stages = eager.training.stages
    assert syncs == [(t, k) for t in range(6) for k in range(stages)]  # a round of one step


def test_delayed_eager_with_two_replicas_trains_apart_from_both_other_rules(
    tmp_path: Path,
) -> None:
    eager, naive = _delayed(tmp_path, "eager", True), _delayed(tmp_path, "naive", False)
    sync = make_job(tmp_path, "sync", training={"steps": 6})
    losses: list[float] = []
    state = _state(train_replicas(eager, replicas=2, on_step=lambda r: losses.append(r.loss)))
    assert all(torch.isfinite(v).all() for v in state.values()) and losses[-1] < losses[0]
    assert _max_diff(state, _state(train_local(naive))) > 1e-6
    assert _max_diff(state, _state(train_local(sync))) > 1e-6
    assert fingerprint(eager) != fingerprint(naive)  # another rule: another job


def test_delayed_eager_runs_on_the_swarm_but_not_with_clipping_or_evaluations(
    tmp_path: Path,
) -> None:
    from scheduler.coordinator import LocalCoordinator

    LocalCoordinator(_delayed(tmp_path, "eager", True), "job", lambda: [])  # runs it
    with pytest.raises(ConfigError, match=r"training\.eval_every.*share no parameters"):
        make_job(
            tmp_path,
            "ev",
            pool={"overlap": "eager"},
            training={"delayed_update": True, "eval_every": 2},
        )
    with pytest.raises(ConfigError, match="grad_clip"):
        make_job(
            tmp_path,
            "clip",
            pool={"overlap": "eager"},
            training={"delayed_update": True, "grad_clip": 1.0},
        )


def test_swarm_local_runs_delayed_eager_as_replicas(tmp_path: Path) -> None:
    training = {"steps": 3, "delayed_update": True}
    job_file = write_job(tmp_path, pool={"overlap": "eager"}, training=training, runtime=RELAY)
    out = tmp_path / "ref.pt"
    assert main(["local", str(job_file), "--replicas", "2", "--out", str(out), *ONE_THREAD]) == 0
    expected = train_replicas(_delayed(tmp_path, "again", True, steps=3), replicas=2)
    state = torch.load(out)
    assert all(torch.equal(v, state[k]) for k, v in expected.state_dict().items())
    naive = write_job(tmp_path, "naive", training=training)  # one model: no replicas to simulate
    assert main(["local", str(naive), "--replicas", "2"]) == 2


def test_a_benchmark_evaluates_the_eager_replicas_mean(tmp_path: Path) -> None:
    """`eval_every` (the reference's, for bench/time_to_loss.py): with the eager overlap the
    replicas share no parameters, so the curve is their mean's; the last evaluation is of the
    trained model (their mean too), and training is the same with or without evaluations."""
    eager = _job(tmp_path, "eager", pool={"overlap": "eager"}, training={"steps": 8})
    evals: list[tuple[int, float]] = []

    def on_step(record: StepRecord) -> None:
        if record.val_loss is not None:
            evals.append((record.step, record.val_loss))

    model = train_replicas(eager, replicas=2, on_step=on_step, eval_every=4)
    assert [step for step, _ in evals] == [0, 4, 8]
    assert evals[0][1] > evals[-1][1]
    assert_states_within(_state(model), _state(train_replicas(eager, replicas=2)), 0.0)
    assert evaluate(eager, model, make_val_data(eager), "cpu") == evals[-1][1]


def _runs(step: int, *peers: str) -> StepRuns:
    """Step `step` of a one-stage job: a microbatch's gradient taken by each of `peers`."""
    return StepRuns(step, tuple(Run(i, (0,), (p,)) for i, p in enumerate(peers)))


def test_a_member_left_out_of_a_round_that_trains_on_is_caught_apart_from_the_replay() -> None:
    # The reference replays the record's rounds as they are: a member left out of a round's
    # group, and recorded so, passes it. `assert_no_member_skipped_a_round` does not.
    start: list[Record] = [Join(0, 0, "a", None), Join(0, 0, "b", None), _runs(0, "a", "b")]
    assert_no_member_skipped_a_round([*start, Sync(0, 0, ("a", "b")), _runs(1, "a", "b")])
    assert_no_member_skipped_a_round([*start, Sync(0, 0, ("a",)), _runs(1, "a")])  # b is gone
    copied = [*start, Sync(0, 0, ("a",)), Join(1, 0, "b", "a"), _runs(1, "a", "b")]
    assert_no_member_skipped_a_round(copied)  # b left the round, and was copied anew
    for after in (_runs(1, "a", "b"), Sync(1, 0, ("a", "b"))):
        with pytest.raises(AssertionError, match="b serves stage 0 after the round of step 0"):
            assert_no_member_skipped_a_round([*start, Sync(0, 0, ("a",)), after])


def test_a_replica_a_restart_left_out_may_join_again(tmp_path: Path) -> None:
    """A scheduler's restart at step 4 (a round's start) found stage 0's r1 gone: the record's
    `resume` names r0 alone, and r1 joins again later as a copy of r0. The replay kept r1 in
    the pool through the resume, and refused its join ("which it already serves")."""
    job = _job(tmp_path, training={"steps": 8})
    records: list[Record] = []
    for r in synthetic_routes(job, 2):
        if isinstance(r, StepRuns) and r.step == 4:
            records.append(Resume(4, 0, ("r0",)))
            records += [Resume(4, k, ("r0", "r1")) for k in range(1, job.training.stages)]
            records.append(Join(4, 0, "r1", "r0"))
        records.append(r)
    train_replicas(job, routes=records)
    # a replica the record never gave the stage cannot resume it
    records = [
        Resume(4, 0, ("ghost",)) if isinstance(r, Resume) and not r.stage else r for r in records
    ]
    with pytest.raises(ConfigError, match="peer 'ghost' resumes stage 0, which the record never"):
        train_replicas(job, routes=records)
