"""Which rule a job's pools follow (`swarm.job.rule`), for each [pool] / delayed_update
combination a job file may hold."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarm.job.rule import EagerOp, RuleKind, rule_of
from swarm.model.optim import computes_on, is_boundary
from tests.support.jobs import make_job


@pytest.mark.parametrize(
    ("pool", "delayed", "kind", "rounds", "every", "delaying"),
    [
        ({}, False, RuleKind.SYNC, False, 1, False),  # per-step averaging
        ({}, True, RuleKind.DELAYED, False, 1, True),  # delayed_update's plain rule
        ({"overlap": "eager"}, True, RuleKind.STEP_EAGER, True, 1, False),  # rounds of one step
        ({"mode": "local", "sync_every": 4}, False, RuleKind.LOCAL, True, 4, False),
        (
            {"mode": "local", "sync_every": 4, "overlap": "eager"},
            False,
            RuleKind.LOCAL_EAGER,
            True,
            4,
            False,
        ),
    ],
)
def test_each_pool_rule_says_its_rounds_and_staleness(
    tmp_path: Path,
    pool: dict[str, object],
    delayed: bool,
    kind: RuleKind,
    rounds: bool,
    every: int,
    delaying: bool,
) -> None:
    job = make_job(
        tmp_path,
        pool=pool,
        training={"steps": 8, "delayed_update": delayed, "checkpoint_every": 0},
        runtime={"data_plane": "relay"},
    )
    rule = rule_of(job)
    assert rule.kind is kind and rule_of(job) is rule  # one object per rule
    assert (rule.rounds, rule.round_steps, rule.delays) == (rounds, every, delaying)
    assert rule.step_eager == (delayed and pool.get("overlap") == "eager")
    assert rule.eager == (pool.get("overlap") == "eager")
    assert rule.records_routes == rounds
    assert ("prev/" in rule.state_copies) == delaying
    assert ("share/" in rule.state_copies) == rule.eager
    assert ("round/synced" in rule.state_markers) == rounds
    assert computes_on(job, 3) == (2 if delaying else 3)
    if rounds:  # a round ends every `every` steps and after the last
        assert [s for s in range(1, 9) if is_boundary(job, s)] == [*range(every, 8, every), 8]


def test_the_eager_operations_are_the_wires() -> None:
    from swarm.proto import stage_pb2 as pb

    assert {op.name: int(op) for op in EagerOp} == {
        name.removeprefix("EAGER_"): value for name, value in pb.EagerOp.items()
    }
