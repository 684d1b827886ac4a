"""A stage server's Prometheus series (served by `swarm.ops.metrics.serve_metrics`)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from stage_server.peer.boundary_traffic import BoundaryTally
from stage_server.peer.links import DIRECTIONS, Direction, LinkMeter
from stage_server.peer.uplink import Uplink
from swarm.ops.boundary_bytes import Way
from swarm.ops.metrics import LABELS, LATENCY_BUCKETS

__all__ = ["PATH_FACTS", "PEER_FACTS", "StageMetrics"]

PEER_FACTS = ("state", "job", "stage")
"""The labels of `swarm_peer_info` besides `peer`: what the peer does now."""
PATH_FACTS = ("reachability", "relay")
"""... and how others reach it: the scheduler's dial-back (unknown, direct, relayed, unreachable)
and the relay it is reached through ("" for none; `stage_server/peer/reachability.py`)."""


class StageMetrics:
    """A stage server's series. The job and stage labels change when the peer is assigned a
    stage (`bind`); the series of earlier assignments stay, as counters should, for the job
    served and the one before it (`KEPT_JOBS`): a scrape sees an ended job's final counts until
    another job after it; older jobs' go (they stayed for good, ~300 samples a job served, and
    its gauges at their last values).

    Each series is looked up once for the labels of the moment (`_series`), not at every count:
    prometheus_client's `labels` checks and builds its key on each call, and the push plane
    counts a dozen times a microbatch on the event loop that relays the next (issue 69)."""

    KEPT_JOBS = 2

    def __init__(self, peer: str, registry: CollectorRegistry | None = None) -> None:
        reg = self.registry = registry or CollectorRegistry()
        # each job's series as made (metric, label values), to remove them with the job; the
        # jobs served, the newest last ("" for none: its series always stay)
        self._made: dict[str, list[tuple[MetricWrapperBase, tuple[str, ...]]]] = {}
        self._served: list[str] = []
        self._making = threading.Lock()  # series are made on the worker's thread too
        self.values = {"job": "", "stage": "", "peer": peer}
        self.facts = ("idle", "", "")  # state, job, stage: what `swarm_peer_info` says
        self.path = ("unknown", "")  # reachability, relay: its other labels
        self._calls()
        self._compute()
        self._traffic()
        self._averaging()
        # the push plane's records of its work (`stage_server.replica.push_records`)
        self._records = self._counter(
            "swarm_stage_push_records_total",
            "Push-plane records kept for audits (none where no audit can run: issue 69)",
        )
        reg.register(_PeerInfo(self))
        # The peer's link rates (`stage_server.peer.links`): measured from its transfers (its
        # pool's streams record theirs in it), or fixed by `--bandwidth`; announced with the
        # peer, read here at each scrape.
        self.link = LinkMeter()
        # The boundary's claims on the uplink, which a standby's updates yield to
        # (`stage_server.peer.uplink`): every boundary send is counted in `sent`, so claimed there.
        self.uplink = Uplink(self.link)
        reg.register(_LinkRates(self))

    def _counter(self, name: str, doc: str, *extra: str) -> Counter:
        return Counter(name, doc, [*LABELS, *extra], registry=self.registry)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, LABELS, registry=self.registry)

    def _calls(self) -> None:
        """The RPCs it handled, by method and code, and how long each took."""
        self._requests = self._counter(
            "swarm_stage_requests_total", "RPCs handled", "method", "code"
        )
        self._latency = Histogram(
            "swarm_stage_request_seconds",
            "RPC handling time by method",
            [*LABELS, "method"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

    def _compute(self) -> None:
        """The stage's work: samples accumulated, steps applied and committed, what waits, and
        the averages it refused to apply."""
        self._samples = self._counter(
            "swarm_stage_samples_total", "Samples accumulated by Backward"
        )
        self._steps = self._counter("swarm_stage_optimizer_steps_total", "Optimizer steps applied")
        self._queue = self._gauge("swarm_stage_queue_depth", "Compute requests waiting or running")
        self._pending = self._gauge(
            "swarm_stage_pending_receipts", "Microbatches accumulated for the current step"
        )
        self._step = self._gauge("swarm_stage_step", "Steps committed on this replica")
        self._nonfinite = self._counter(
            "swarm_stage_nonfinite_gradients_total",
            "Prepared averages found NaN or infinite: reported to the coordinator, never applied",
        )

    def _traffic(self) -> None:
        """The tensor bytes it moved: on the wire and decoded, across its boundaries (and the
        tokens they carried), and handed over through memory instead."""
        self._wire_in = self._counter(
            "swarm_stage_wire_bytes_received_total", "Tensor bytes received, as encoded on the wire"
        )
        self._raw_in = self._counter(
            "swarm_stage_raw_bytes_received_total",
            "Tensor bytes received, decoded (before compression)",
        )
        self._wire_out = self._counter(
            "swarm_stage_wire_bytes_sent_total", "Tensor bytes sent, as encoded on the wire"
        )
        self._raw_out = self._counter(
            "swarm_stage_raw_bytes_sent_total", "Tensor bytes sent, before compression"
        )
        self._boundary_bytes = self._counter(
            "swarm_stage_boundary_bytes_sent_total",
            "Tensor bytes sent across the stage's boundaries, as encoded on the wire: its outputs "
            "forward, its input gradient backward",
            "direction",
        )
        self._boundary_tokens = self._counter(
            "swarm_stage_boundary_tokens_sent_total",
            "Tokens carried by the tensors of swarm_stage_boundary_bytes_sent_total",
            "direction",
        )
        self._handovers = self._counter(
            "swarm_stage_handovers_total",
            "Boundary tensors between co-located stage servers handed over through memory "
            "(stage_server/replica/handing.py), by way: offered (an activation sent), filled (a "
            "gradient answered), taken (one received); each one's bytes went on no wire; and "
            "refused (a replica pushed to could not take one: that push went on the wire)",
            "way",
        )
        # The same since `bind`, for the load reports (`stage_server.peer.boundary_traffic`).
        self.boundary = BoundaryTally()

    def _averaging(self) -> None:
        """Its pool's averaging rounds: their time and the gradient bytes each way."""
        self._avg_seconds = Histogram(
            "swarm_stage_averaging_seconds",
            "Time of a pool's averaging round",
            LABELS,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._avg_sent = self._counter(
            "swarm_stage_averaging_bytes_sent_total",
            "Gradient bytes sent to the pool while averaging",
        )
        self._avg_received = self._counter(
            "swarm_stage_averaging_bytes_received_total",
            "Gradient bytes received from the pool while averaging",
        )

    @property
    def values(self) -> dict[str, str]:
        """The job, stage and peer labels of the series counted from now on."""
        return self._labelled[0]

    @values.setter
    def values(self, values: dict[str, str]) -> None:
        # The labels and their series, as one: a count on another thread (the worker's) that
        # read the old labels keeps the series it looks up with them, not with the new ones.
        self._labelled: tuple[dict[str, str], dict[tuple[Any, ...], Any]] = (values, {})

    def _of(self, metric: MetricWrapperBase, *extra: str) -> Any:
        """`metric`'s series for `values` and its own labels `extra` (in its label names'
        order after `LABELS`), as `metric.labels` gives it, kept for the next count."""
        values, series = self._labelled
        key = (metric, *extra)
        found = series.get(key)
        if found is None:
            labels = (*(values[k] for k in LABELS), *extra)
            found = series[key] = metric.labels(*labels)
            with self._making:
                self._made.setdefault(values["job"], []).append((metric, labels))
        return found

    def identify(self, peer: str) -> None:
        """The peer id is `peer` (known once the server listens: it may default to its address)."""
        self.values = {**self.values, "peer": peer}

    def bind(self, job: str, stage: int) -> None:
        """Serving `stage` of `job` from now on: the labels of the series to come; the series
        of jobs served before the last `KEPT_JOBS` go."""
        self.values = {**self.values, "job": job, "stage": str(stage)}
        if job in self._served:
            self._served.remove(job)
        self._served.append(job)
        while len(gone := [j for j in self._served if j][: -self.KEPT_JOBS]):
            self._served.remove(gone[0])
            with self._making:
                made = self._made.pop(gone[0], [])
            for metric, labels in made:
                with contextlib.suppress(KeyError):  # (made twice by two threads at once)
                    metric.remove(*labels)
        self.boundary = BoundaryTally()
        self.became("serving", job, stage)

    def became(self, state: str, job: str = "", stage: int | None = None) -> None:
        """`swarm_peer_info` says the peer is in `state` (idle, fetching, measuring, waiting,
        building, serving, moving, offline) for `job` and `stage` ("" for none)."""
        self.facts = (state, job, "" if stage is None else str(stage))

    def reached(self, reachability: str, relay: str = "") -> None:
        """`swarm_peer_info` says others reach the peer so (`PATH_FACTS`)."""
        self.path = (reachability, relay)

    def info(self) -> dict[str, str]:
        """The labels of the one `swarm_peer_info` series now."""
        return {
            "peer": self.values["peer"],
            **dict(zip(PEER_FACTS, self.facts, strict=True)),
            **dict(zip(PATH_FACTS, self.path, strict=True)),
        }

    def observe(self, method: str, code: str, seconds: float) -> None:
        self._of(self._requests, method, code).inc()
        self._of(self._latency, method).observe(seconds)

    def received(self, wire_bytes: int, raw_bytes: int) -> None:
        self._of(self._wire_in).inc(wire_bytes)
        self._of(self._raw_in).inc(raw_bytes)

    def handed(self, way: str) -> None:
        """A tensor handed over (`stage_server.replica.handing`): "offered", "filled", "taken";
        "refused": a replica pushed to could not take it, and got the bytes instead."""
        self._of(self._handovers, way).inc()

    def sent(self, wire_bytes: int, raw_bytes: int, direction: Way, tokens: int) -> None:
        """A boundary tensor sent `direction` (`stage_server.peer.boundary_traffic`): its
        `wire_bytes` as encoded, `raw_bytes` before, the `tokens` it carries."""
        self._of(self._wire_out).inc(wire_bytes)
        self._of(self._raw_out).inc(raw_bytes)
        self._of(self._boundary_bytes, direction).inc(wire_bytes)
        self._of(self._boundary_tokens, direction).inc(tokens)
        self.boundary.add(direction, wire_bytes, tokens)
        self.uplink.claim(wire_bytes)

    def passed_on(self, wire_bytes: int, raw_bytes: int) -> None:
        """A tensor sent beside a boundary tensor, not one (the targets and token ids a push
        passes on): its bytes, and no boundary's; the boundary's figure stays its tensor's."""
        self._of(self._wire_out).inc(wire_bytes)
        self._of(self._raw_out).inc(raw_bytes)

    def recorded(self) -> None:
        """A push record kept (`stage_server.replica.push_records`)."""
        self._of(self._records).inc()

    def records_kept(self) -> float:
        """The push records kept since the last `bind`'s labels: the tests read it."""
        return float(self._of(self._records)._value.get())

    def accumulated(self, samples: int, pending: int) -> None:
        self._of(self._samples).inc(samples)
        self._of(self._pending).set(pending)

    def committed(self, step: int, applied: bool) -> None:
        if applied:
            self._of(self._steps).inc()
        self._of(self._step).set(step)
        self._of(self._pending).set(0)

    def nonfinite(self) -> None:
        self._of(self._nonfinite).inc()

    def averaged(self, sent: int, received: int) -> None:
        self._of(self._avg_sent).inc(sent)
        self._of(self._avg_received).inc(received)

    def averaging_seconds(self, seconds: float) -> None:
        self._of(self._avg_seconds).observe(seconds)
        self.link.settle(0.0)  # the round's streams are over: their burst is a sample now

    def moved(self, direction: Direction, nbytes: int, seconds: float) -> None:
        """`nbytes` went `direction` in `seconds` on the wire (a state download, activations)."""
        self.link.transferred(direction, nbytes, seconds)

    def queue(self, delta: int) -> None:
        self._of(self._queue).inc(delta)


class _PeerInfo(Collector):
    """`swarm_peer_info`: 1 from the start, so an idle peer (no job yet, no other series) is seen
    too. What the peer does now is in its labels, not in Prometheus's target labels (where each
    change starts a new series of every metric); read whole at each scrape, it is always exactly
    one series, so `sum by (peer)` never counts a peer twice nor misses it."""

    def __init__(self, metrics: StageMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = self.metrics.info()
        family = GaugeMetricFamily(
            "swarm_peer_info",
            "This stage server (1): what it does now (state), for which job and stage; how others "
            "reach it (reachability, relay)",
            labels=list(labels),
        )
        family.add_metric(list(labels.values()), 1)
        yield family


class _LinkRates(Collector):
    """`swarm_peer_link_bytes_per_second{direction="up"|"down"}`: the rates the peer announces
    (0: unknown yet), read from its meter at each scrape."""

    def __init__(self, metrics: StageMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "swarm_peer_link_bytes_per_second",
            "This peer's link rate, bytes/s, measured from its transfers or set by --bandwidth",
            labels=["peer", "direction"],
        )
        for direction in DIRECTIONS:
            rate = self.metrics.link.rate(direction)
            family.add_metric([self.metrics.values["peer"], direction], rate)
        yield family
