"""What a job's rounds tell `swarm status` and /metrics, against in-memory replicas: the rule, the
round under way, the steps to the next average, and each average's time and bytes (a pool of N
replicas moves 2 (N - 1) x its stage's parameter bytes); `promtool` accepts the series."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from scheduler.coordinator.metrics import CoordinatorMetrics
from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.model.transformer import stage_layout
from tests.support.coordinator import LEASE_S, Harness, MakeHarness, job_of, until
from tests.support.jobs import make_job
from tests.support.replicas import FakeSwarm

pytestmark = pytest.mark.timeout(60)


def _harness(job: JobConfig, make: MakeHarness) -> tuple[Harness, CollectorRegistry]:
    """Stage 0 served by a and b, stage 1 by c; the job's series in a registry of their own."""
    swarm = FakeSwarm(fingerprint(job), 2)
    swarm.add(0, "a"), swarm.add(0, "b"), swarm.add(1, "c")
    registry = CollectorRegistry()
    h = make(job, swarm, metrics=CoordinatorMetrics(swarm.job_id, registry))
    return h, registry


def _job(tmp_path: Path, overlap: str = "none", steps: int = 5) -> JobConfig:
    training = {"stages": 2, "microbatch_size": 4, "target_batch_size": 8, "steps": steps}
    runtime = {"lease_timeout_s": LEASE_S}
    pool = {"mode": "local", "sync_every": 2, "overlap": overlap}
    return make_job(tmp_path, training=training, runtime=runtime, pool=pool)


def _sample(registry: CollectorRegistry, name: str) -> float | None:
    """The one series of `name` in `registry` (each job has its own registry here)."""
    values = [s.value for m in registry.collect() for s in m.samples if s.name == name]
    assert len(values) <= 1, (name, values)
    return values[0] if values else None


async def test_a_local_job_says_its_round_and_its_last_average(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    job = _job(tmp_path)
    h, registry = _harness(job, make_harness)
    await h.coordinator.start()
    rounds = h.coordinator.rounds
    first = rounds.status(0)
    assert first is not None
    assert (first.rule, first.round, first.rounds, first.round_steps) == ("local", 1, 3, 2)
    assert (first.next_average_in, first.last_at, first.last_bytes) == (2, 0.0, 0)
    assert _sample(registry, "swarm_coordinator_round") == 1
    await h.step()
    assert rounds.status(1).next_average_in == 1  # type: ignore[union-attr]
    await h.step()  # the round [0, 1] ends: stage 0's pool of 2 averages, stage 1's c alone
    after = rounds.status(2)
    assert after is not None and (after.round, after.next_average_in) == (2, 2)
    stage0 = sum(p.numel() * 8 for p in stage_layout(job, 0).parameters())  # float64
    assert after.last_bytes == 2 * (2 - 1) * stage0 > 0
    assert after.last_seconds >= 0 and after.last_at > 0
    assert _sample(registry, "swarm_coordinator_round") == 2
    assert _sample(registry, "swarm_coordinator_round_seconds_count") == 1
    assert _sample(registry, "swarm_coordinator_round_bytes_total") == after.last_bytes
    for _ in range(3):
        await h.step()
    end = rounds.status(5)  # 5 steps in rounds of 2: the last round is step 4 alone
    assert end is not None and (end.round, end.rounds, end.next_average_in) == (3, 3, 0)
    assert _sample(registry, "swarm_coordinator_round_seconds_count") == 3
    promtool = shutil.which("promtool")
    assert promtool, "install the Debian package prometheus (make test does)"
    lint = subprocess.run(
        [promtool, "check", "metrics"], input=generate_latest(registry), capture_output=True
    )
    assert lint.returncode == 0, (lint.stdout, lint.stderr)


async def test_an_eager_job_times_its_background_sums(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    job = _job(tmp_path, "eager", steps=4)
    h, registry = _harness(job, make_harness)
    await h.coordinator.start()
    for _ in range(2):
        await h.step()
    # The round's sum runs in the background: once it ended, it is the last average.
    await until(lambda: _sample(registry, "swarm_coordinator_round_seconds_count") == 1)
    status = h.coordinator.rounds.status(2)
    assert status is not None and status.rule == "local-eager" and status.last_bytes > 0
    for _ in range(2):
        await h.step()  # the last round: its sum and the members' mean
    assert _sample(registry, "swarm_coordinator_round_seconds_count") == 2
    assert _sample(registry, "swarm_coordinator_round_bytes_total") == 3 * status.last_bytes


async def test_a_job_without_rounds_has_no_round_status_nor_series(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    job = job_of(tmp_path)
    swarm = FakeSwarm(fingerprint(job), 2)
    swarm.add(0, "a"), swarm.add(1, "c")
    registry = CollectorRegistry()
    h = make_harness(job, swarm, metrics=CoordinatorMetrics(swarm.job_id, registry))
    await h.coordinator.start()
    await h.step()
    assert h.coordinator.rounds.status(1) is None
    assert _sample(registry, "swarm_coordinator_round") is None
