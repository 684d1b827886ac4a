"""The scheduler's Prometheus gauges of live state: peers per job, stage and state, each stage's
measured throughput, each job's state, step and loss, and each present peer's reachability as
the scheduler's dial-back found it (`swarm_peer_reachability`, 1 for its current one), and the
bytes per token crossing each of a job's boundaries each way, as the replicas' load reports say
(`swarm_scheduler_boundary_bytes_per_token`). A peer
counts as serving its stage only once the job's coordinator admitted it (`PeerRegistry.shown`):
until then it is joining, or a standby when the coordinator keeps it as one (`standby`: it
follows the stage's updates and serves nothing, issue 67).

Why a collector and not gauges kept up to date: these are computed at scrape time from what the
scheduler already holds, so there is nothing to keep in sync, and a job's series go when it
leaves the scheduler's snapshot. The scrape runs on the metrics server's thread, so it reads only
what is safe there: a copy of the peer registry's announcements and the scheduler's `snapshot` of
job records (never the store, whose connection belongs to the event loop's thread).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from scheduler.registry import PeerRegistry
from scheduler.store import JobRecord
from swarm.job.states import JOB_STATES, peer_state_name
from swarm.ops.boundary_bytes import per_token
from swarm.proto import control_pb2 as cpb

__all__ = ["SchedulerView", "collector"]

_REACHABILITY = {
    cpb.REACHABILITY_UNKNOWN: "unknown",
    cpb.REACHABILITY_DIRECT: "direct",
    cpb.REACHABILITY_RELAYED: "relayed",
    cpb.REACHABILITY_UNREACHABLE: "unreachable",
}


class SchedulerView(Protocol):
    """What the collector reads of the scheduler."""

    peer_registry: PeerRegistry
    snapshot: dict[str, JobRecord]  # the latest record of each job, refreshed on the event loop

    def admitted(self, job_id: str) -> frozenset[str] | None:
        """The job's admitted replicas (None: no coordinator); safe on the metrics thread."""
        ...

    def standbys(self, job_id: str) -> frozenset[str]:
        """The job's standbys (none without a coordinator); safe on the metrics thread."""
        ...


def collector(scheduler: SchedulerView) -> Collector:
    """A Prometheus collector computing peers per stage and state, per-stage throughput, and job
    state, step and loss at scrape time from the scheduler's live state (nothing to sync)."""

    class _Collector(Collector):
        def collect(self) -> Iterable[Metric]:
            peers = GaugeMetricFamily(
                "swarm_scheduler_peers",
                "Peers by job, stage and state",
                labels=["job", "stage", "state"],
            )
            speed = GaugeMetricFamily(
                "swarm_scheduler_stage_samples_per_second",
                "Summed measured samples/s of a stage's serving replicas",
                labels=["job", "stage"],
            )
            counts: dict[tuple[str, str, str], int] = {}
            totals: dict[tuple[str, str], float] = {}
            registry = scheduler.peer_registry
            present = list(registry.peers.values())
            known = set(scheduler.snapshot)  # a job a peer names is its word: labels ours only
            shown = {
                s.announcement.peer: (str(s.stage), s.state)
                for job in {p.job for p in present if p.job in known}
                for s in registry.shown(
                    job, scheduler.admitted(job), standbys=scheduler.standbys(job)
                )
            }
            for p in present:
                job = p.job if p.job in known else ""
                announced = (str(p.stage) if p.HasField("stage") and job else "", p.state)
                stage, shown_state = shown.get(p.peer, announced)
                state = peer_state_name(shown_state)
                counts[(job, stage, state)] = counts.get((job, stage, state), 0) + 1
                if shown_state == cpb.PEER_STATE_SERVING and stage:
                    key = (job, stage)
                    totals[key] = totals.get(key, 0.0) + p.samples_per_second.get(p.stage, 0.0)
            for labels, n in counts.items():
                peers.add_metric(list(labels), n)
            for labels2, value in totals.items():
                speed.add_metric(list(labels2), value)
            job_state = GaugeMetricFamily(
                "swarm_job_state", "1 for the job's current state", labels=["job", "state"]
            )
            step = GaugeMetricFamily("swarm_job_step", "Steps committed", labels=["job"])
            loss = GaugeMetricFamily(
                "swarm_job_loss", "Loss of the last committed step", labels=["job"]
            )
            for job_id, record in list(scheduler.snapshot.items()):
                for name in JOB_STATES:
                    job_state.add_metric([job_id, name], 1.0 if name == record.state else 0.0)
                step.add_metric([job_id], record.step)
                if not math.isnan(record.loss):
                    loss.add_metric([job_id], record.loss)
            reach = GaugeMetricFamily(
                "swarm_peer_reachability",
                "1 for how the scheduler's dial-back reached the peer (direct, relayed, "
                "unreachable; unknown: not checked yet)",
                labels=["peer", "reachability"],
            )
            for p in present:
                report = registry.reachability(p.peer)
                now = report.reachability if report is not None else cpb.REACHABILITY_UNKNOWN
                for value, label in _REACHABILITY.items():
                    reach.add_metric([p.peer, label], 1.0 if value == now else 0.0)
            yield from (peers, speed, job_state, step, loss, reach, _boundaries(scheduler))

    return _Collector()


def _boundaries(scheduler: SchedulerView) -> GaugeMetricFamily:
    """`swarm_scheduler_boundary_bytes_per_token{job,boundary,direction}`: at boundary "K|K+1",
    the bytes per token stage K's replicas sent `forward` and stage K+1's sent `backward`, as
    their load reports say (`swarm.ops.boundary_bytes`); none before a token crossed."""
    family = GaugeMetricFamily(
        "swarm_scheduler_boundary_bytes_per_token",
        "Bytes per token sent across a boundary between two stages, as encoded on the wire",
        labels=["job", "boundary", "direction"],
    )
    registry, known = scheduler.peer_registry, set(scheduler.snapshot)
    for job in sorted({p.job for p in list(registry.peers.values()) if p.job in known}):
        sent: dict[int, list[cpb.BoundaryTraffic]] = {}
        for shown in registry.shown(job, scheduler.admitted(job)):
            said = registry.boundary(shown.announcement.peer, job, shown.stage)
            if said is not None:  # what it sent counts, admitted or not yet
                sent.setdefault(shown.stage, []).append(said)
        for k, traffic in sorted(sent.items()):  # the last stage sends nothing forward,
            forward, backward = per_token(traffic, "forward"), per_token(traffic, "backward")
            if forward is not None:
                family.add_metric([job, f"{k}|{k + 1}", "forward"], forward)
            if backward is not None:  # the first nothing backward: no token, no sample
                family.add_metric([job, f"{k - 1}|{k}", "backward"], backward)
    return family
