"""Every training rule (`swarm.job.rule.RuleKind`) on one in-process swarm: two replicas of each
of two stages, two trainers, the coordinator recording the route record; the parameters the
swarm ends with equal `swarm local`'s (the reference replaying the record, for the rules with
rounds), and differ from the synchronous rule's but for that rule itself. A rule is a row of
`tests.support.jobs.RULES`, and so a case here."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler.coordinator import LocalCoordinator, gather_state
from swarm.job.fingerprint import fingerprint
from swarm.job.rule import RuleKind, rule_of
from swarm.model.routes import Record, StepRuns
from tests.support.equality import assert_equal_to_reference, local_state
from tests.support.inprocess import Swarm
from tests.support.jobs import make_job, with_rule

TRAINING = {"stages": 2, "steps": 5, "target_batch_size": 16, "checkpoint_every": 0}


@pytest.mark.parametrize("kind", list(RuleKind))
async def test_the_swarm_under_every_rule_equals_swarm_local(
    tmp_path: Path, make_swarm: list[Swarm], kind: RuleKind
) -> None:
    job = make_job(tmp_path, **with_rule(kind, training=TRAINING, runtime={"data_plane": "relay"}))
    assert rule_of(job).kind is kind
    swarm = Swarm(job)
    make_swarm.append(swarm)
    await swarm.add_replicas(2)
    routes: list[Record] = []
    coordinator = LocalCoordinator(job, fingerprint(job), swarm.members, on_route=routes.append)
    try:
        await swarm.train(coordinator, trainers=2)
        state = await gather_state(coordinator)
    finally:
        await coordinator.close()
    recorded = [r.step for r in routes if isinstance(r, StepRuns)]
    assert recorded == (list(range(5)) if rule_of(job).records_routes else [])
    assert_equal_to_reference(job, state, routes, tol=1e-9)
    if kind is not RuleKind.SYNC:  # the rule is not idle: the synchronous one ends elsewhere
        sync = local_state(make_job(tmp_path, "sync", training=TRAINING))
        far = max((state[k] - v).abs().max().item() for k, v in sync.items())
        assert far > 1e-6, far
