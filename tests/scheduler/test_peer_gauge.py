"""`swarm_scheduler_peers{job,stage,state}` (scheduler/collector.py, docs/metrics.md): the
scheduler's peers per stage in the state status shows them."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry

from scheduler.collector import collector
from scheduler.registry import PeerRegistry
from scheduler.store import JobRecord
from swarm.clock import FakeClock
from swarm.proto import control_pb2 as cpb


class _View:
    """What the collector reads of a scheduler (`scheduler.collector.SchedulerView`): one job
    "j" whose coordinator admitted `members` and keeps `standing` as standbys."""

    def __init__(self, registry: PeerRegistry, members: set[str], standing: set[str]) -> None:
        record = JobRecord("j", "j", "", "/", "running", 0, 3, math.nan, "", "", 0.0, 0.0)
        self.peer_registry, self.snapshot = registry, {"j": record}
        self.members, self.standing = frozenset(members), frozenset(standing)
        self.asked: list[str] = []  # the jobs `admitted` was asked of

    def admitted(self, job_id: str) -> frozenset[str] | None:
        self.asked.append(job_id)
        return self.members if job_id == "j" else None

    def standbys(self, job_id: str) -> frozenset[str]:
        return self.standing if job_id == "j" else frozenset()


def _serving(peer: str, stage: int) -> cpb.PeerAnnouncement:
    return cpb.PeerAnnouncement(
        peer=peer, address=f"{peer}:1", job="j", stage=stage, state=cpb.PEER_STATE_SERVING
    )


def test_a_standby_counts_as_standby_not_joining() -> None:
    # Issue 67: a standby announces that it serves its stage, is no member, and status shows it
    # as STANDBY; the gauge counted it with the joiners, so a dashboard's "joining" never drained.
    registry = PeerRegistry(FakeClock(), load_silence_s=10.0, serve_timeout_s=60.0)
    for name in "abc":
        registry.announce(_serving(name, 0))
    metrics = CollectorRegistry()
    metrics.register(collector(_View(registry, members={"a"}, standing={"b"})))
    counts = {
        (s.labels["stage"], s.labels["state"]): s.value
        for family in metrics.collect()
        if family.name == "swarm_scheduler_peers"
        for s in family.samples
        if s.labels["job"] == "j"
    }
    assert counts == {("0", "serving"): 1.0, ("0", "standby"): 1.0, ("0", "joining"): 1.0}


def test_a_job_a_peer_names_is_no_label_and_no_walk_unless_the_scheduler_knows_it() -> None:
    """Each job name peers announced was walked (every peer sorted, twice) and became a label
    value: made-up peers naming made-up jobs held the scrape for minutes at 16,384 of each, and
    every new name was a new series in Prometheus (a review of unbounded state found it)."""
    registry = PeerRegistry(FakeClock(), load_silence_s=10.0, serve_timeout_s=60.0)
    registry.announce(_serving("a", 0))
    for i in range(200):
        made_up = _serving(f"s{i}", 0)
        made_up.job = f"made-up-{i}"
        registry.announce(made_up)
    view = _View(registry, members={"a"}, standing=set())
    metrics = CollectorRegistry()
    metrics.register(collector(view))
    jobs = {
        s.labels["job"]
        for family in metrics.collect()
        if family.name in ("swarm_scheduler_peers", "swarm_scheduler_boundary_bytes_per_token")
        for s in family.samples
    }
    assert jobs <= {"j", ""}, sorted(jobs)[:5]
    assert set(view.asked) == {"j"}
