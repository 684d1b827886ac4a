"""Which rule a job's pools follow (`swarm.job.pool_rules`), for each [pool] / delayed_update
combination a job file may hold."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarm.job.pool_rules import delays, has_rounds, round_steps, step_eager
from swarm.model.optim import computes_on, is_boundary
from tests.support.jobs import make_job


@pytest.mark.parametrize(
    ("pool", "delayed", "rounds", "every", "delaying"),
    [
        ({}, False, False, 16, False),  # per-step averaging
        ({}, True, False, 16, True),  # delayed_update's plain rule
        ({"overlap": "eager"}, True, True, 1, False),  # its eager rule: rounds of one step
        ({"mode": "local", "sync_every": 4}, False, True, 4, False),
        ({"mode": "local", "sync_every": 4, "overlap": "eager"}, False, True, 4, False),
    ],
)
def test_each_pool_rule_says_its_rounds_and_staleness(
    tmp_path: Path,
    pool: dict[str, object],
    delayed: bool,
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
    assert (has_rounds(job), round_steps(job), delays(job)) == (rounds, every, delaying)
    assert step_eager(job) == (delayed and pool.get("overlap") == "eager")
    assert computes_on(job, 3) == (2 if delaying else 3)
    if rounds:  # a round ends every `every` steps and after the last
        assert [s for s in range(1, 9) if is_boundary(job, s)] == [*range(every, 8, every), 8]
