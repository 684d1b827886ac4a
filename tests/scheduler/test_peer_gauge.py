"""`swarm_scheduler_peers{job,stage,state}` (scheduler/collector.py, docs/metrics.md): the
scheduler's peers per stage in the state status shows them."""

from __future__ import annotations

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
        self.peer_registry, self.snapshot = registry, dict[str, JobRecord]()
        self.members, self.standing = frozenset(members), frozenset(standing)

    def admitted(self, job_id: str) -> frozenset[str] | None:
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
