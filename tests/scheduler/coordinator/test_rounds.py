"""`pool.mode = "local"` at the coordinator, against in-memory replicas: each replica's local step
over its own samples, the rounds' two phases, a member that fails a round (dropped, its round's
samples counted and said), joins only where a round starts, and the route record."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from swarm.errors import PeerUnavailable
from swarm.model.routes import Join, Record, StepRuns, Sync
from tests.support.coordinator import LEASE_S, Harness, until
from tests.support.jobs import make_job
from tests.support.replicas import FakeSwarm, Prepared

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def made() -> AsyncIterator[list[Harness]]:
    harnesses: list[Harness] = []
    yield harnesses
    for h in harnesses:
        await h.coordinator.close()


def _local(tmp_path: Path, steps: int = 4) -> object:
    training = {"stages": 2, "microbatch_size": 4, "target_batch_size": 8, "steps": steps,
                "checkpoint_every": 0}  # fmt: skip
    runtime = {"lease_timeout_s": LEASE_S, "data_plane": "relay"}
    return make_job(
        tmp_path, training=training, runtime=runtime, pool={"mode": "local", "sync_every": 2}
    )


async def test_local_steps_commit_alone_and_rounds_average_the_pool(
    tmp_path: Path, made: list[Harness]
) -> None:
    job = _local(tmp_path)
    swarm = FakeSwarm(job.fingerprint(), 2)  # type: ignore[attr-defined]
    a, b, c = swarm.add(0, "a"), swarm.add(0, "b"), swarm.add(1, "c")
    records: list[Record] = []
    said: list[str] = []
    h = Harness(job, swarm, on_route=records.append, on_status=said.append)  # type: ignore[arg-type]
    made.append(h)
    await h.coordinator.start()
    await h.step({0: "a"})  # microbatch 0 at a, 1 at a: b took none in step 0
    assert a.called("prepare") == [Prepared(0, [0, 1], 8, ["fake:a"], 0, "0/0")]
    assert b.called("prepare") == [Prepared(0, [], 0, ["fake:b"], 0, "0/0")]
    assert not a.called("prepare_round")
    tasks = await h.lease()
    await h.run(tasks[0], {0: "a"})
    await h.run(tasks[1], {0: "b"})
    await asyncio.wait_for(h.steps.get(), 10)
    # The round after step 1: a took 12 samples, b 4; the group weighs them together.
    assert a.called("prepare_round") == [(2, 16, ["fake:a", "fake:b"], "1/round0")]
    assert b.called("prepare_round") == [(2, 16, ["fake:a", "fake:b"], "1/round0")]
    assert c.called("prepare_round") == [(2, 16, ["fake:c"], "1/round0")]
    phases = [m for _, m in swarm.log if m in ("prepare_round", "apply_round")]
    assert phases == ["prepare_round"] * 3 + ["apply_round"] * 3
    # b fails the next round: it is dropped, the round repeats without it, its samples counted.
    b.fail("prepare_round", PeerUnavailable("b died"))
    await h.step({0: "b"})
    await h.step({0: "b"})
    assert a.called("prepare_round")[-1] == (4, 0, ["fake:a"], "3/round1")
    assert h.coordinator.metrics.round_dropped._value.get() == 16
    assert said and "stage 0: b left mid-round, 16 samples dropped" in said[-1]
    joins = [(r.step, r.stage, r.peer, r.source) for r in records if isinstance(r, Join)]
    assert joins == [(0, 0, "a", None), (0, 0, "b", None), (0, 1, "c", None)]
    syncs = [(r.step, r.stage, r.group) for r in records if isinstance(r, Sync)]
    assert syncs == [(1, 0, ("a", "b")), (1, 1, ("c",)), (3, 0, ("a",)), (3, 1, ("c",))]
    runs = [r for r in records if isinstance(r, StepRuns)]
    assert [r.step for r in runs] == [0, 1, 2, 3]


async def test_a_copy_joins_only_where_a_round_starts(tmp_path: Path, made: list[Harness]) -> None:
    job = _local(tmp_path, steps=6)
    swarm = FakeSwarm(job.fingerprint(), 2)  # type: ignore[attr-defined]
    swarm.add(0, "a"), swarm.add(1, "c")
    records: list[Record] = []
    h = Harness(job, swarm, on_route=records.append)  # type: ignore[arg-type]
    made.append(h)
    await h.coordinator.start()
    tasks = await h.lease()
    swarm.add(0, "b", step=0)  # comes during step 0: it copies a from step 1 on, mid-round
    for task in tasks:
        await h.run(task)
    await asyncio.wait_for(h.steps.get(), 10)
    await until(lambda: swarm["b"].called("join") != [])
    assert "b" not in {r.peer for r in h.coordinator.replicas()[0]}
    await h.step()
    await until(lambda: "b" in {r.peer for r in h.coordinator.replicas()[0]})
    joins = [(r.step, r.stage, r.peer, r.source) for r in records if isinstance(r, Join)]
    assert joins[-1] == (2, 0, "b", "a")
