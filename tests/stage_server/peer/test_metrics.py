"""A stage server's series keep each count under the labels of its moment, though each series is
looked up once per labels (`StageMetrics._of`, issue 69): a `bind` or an `identify` sends the
counts after it to the new labels' series, and leaves the old ones as they were."""

from __future__ import annotations

from stage_server.peer.metrics import StageMetrics


def value(metrics: StageMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_counts_follow_the_labels_of_their_moment() -> None:
    metrics = StageMetrics("p1")
    metrics.received(10, 20)
    metrics.received(1, 2)
    idle = {"job": "", "stage": "", "peer": "p1"}
    assert value(metrics, "swarm_stage_wire_bytes_received_total", **idle) == 11.0

    metrics.bind("j", 2)
    metrics.received(5, 6)
    metrics.observe("Push", "OK", 0.5)
    metrics.observe("Push", "OK", 0.25)
    metrics.observe("Push", "UNAVAILABLE", 0.1)
    serving = {"job": "j", "stage": "2", "peer": "p1"}
    assert value(metrics, "swarm_stage_wire_bytes_received_total", **idle) == 11.0
    assert value(metrics, "swarm_stage_wire_bytes_received_total", **serving) == 5.0
    assert value(metrics, "swarm_stage_raw_bytes_received_total", **serving) == 6.0
    ok = {**serving, "method": "Push", "code": "OK"}
    assert value(metrics, "swarm_stage_requests_total", **ok) == 2.0
    failed = {**serving, "method": "Push", "code": "UNAVAILABLE"}
    assert value(metrics, "swarm_stage_requests_total", **failed) == 1.0
    push = {**serving, "method": "Push"}
    assert value(metrics, "swarm_stage_request_seconds_count", **push) == 3.0

    metrics.identify("p2")
    metrics.received(7, 8)
    metrics.handed("taken")
    renamed = {**serving, "peer": "p2"}
    assert value(metrics, "swarm_stage_wire_bytes_received_total", **serving) == 5.0
    assert value(metrics, "swarm_stage_wire_bytes_received_total", **renamed) == 7.0
    assert value(metrics, "swarm_stage_handovers_total", **renamed, way="taken") == 1.0
    assert metrics.values == renamed


def test_gauges_and_records_read_the_current_series() -> None:
    metrics = StageMetrics("p")
    metrics.bind("j", 0)
    metrics.queue(1)
    metrics.queue(1)
    metrics.queue(-1)
    metrics.accumulated(8, 3)
    metrics.committed(1, applied=True)
    metrics.recorded()
    labels = {"job": "j", "stage": "0", "peer": "p"}
    assert value(metrics, "swarm_stage_queue_depth", **labels) == 1.0
    assert value(metrics, "swarm_stage_samples_total", **labels) == 8.0
    assert value(metrics, "swarm_stage_pending_receipts", **labels) == 0.0
    assert value(metrics, "swarm_stage_step", **labels) == 1.0
    assert metrics.records_kept() == 1.0
    metrics.bind("j", 1)  # a new stage: its own series, none kept there yet
    assert metrics.records_kept() == 0.0


def test_the_series_of_jobs_before_the_last_two_go() -> None:
    """A server serving job after job kept every job's series for good (~300 samples each, and
    its gauges at their last values); the job served and the one before it stay, so a scrape
    sees an ended job's final counts until the job after it."""
    metrics = StageMetrics("p1")
    for n in range(4):
        metrics.bind(f"job{n}", 0)
        metrics.observe("Push", "OK", 0.5)
        metrics.received(1, 2)
    exposed = {s.labels.get("job") for f in metrics.registry.collect() for s in f.samples}
    assert {"job0", "job1"}.isdisjoint(exposed), exposed
    assert {"job2", "job3"} <= exposed
    serving = {"job": "job3", "stage": "0", "peer": "p1"}
    assert value(metrics, "swarm_stage_wire_bytes_received_total", **serving) == 1.0
    metrics.bind("job2", 1)  # served again: its series stay, and job3's as the one before
    exposed = {s.labels.get("job") for f in metrics.registry.collect() for s in f.samples}
    assert {"job2", "job3"} <= exposed
