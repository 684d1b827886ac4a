"""Prometheus finds the swarm by itself: the scheduler's `/sd` (the `http_sd_configs` format) lists
itself and every live peer; the real Prometheus server, given only that URL, scrapes a series from
every process; `promtool check metrics` passes on every `/metrics`."""

from __future__ import annotations

from scheduler.discovery import sd_targets
from swarm.proto import control_pb2 as cpb


def test_sd_lists_the_scheduler_and_each_peer_with_a_metrics_port() -> None:
    serving = cpb.PeerAnnouncement(
        peer="p1", metrics_address="10.0.0.2:9101", state=cpb.PEER_STATE_SERVING, job="j-1", stage=2
    )
    idle = cpb.PeerAnnouncement(peer="p0", metrics_address="[fd00::3]:9101")
    blind = cpb.PeerAnnouncement(peer="p2", address="10.0.0.4:7000")  # no /metrics: not listed
    groups = sd_targets("10.0.0.1:9100", [serving, idle, blind])
    assert groups == [
        {"targets": ["10.0.0.1:9100"], "labels": {"swarm_role": "scheduler"}},
        {
            "targets": ["[fd00::3]:9101"],
            "labels": {
                "swarm_role": "peer",
                "swarm_peer": "p0",
                "swarm_state": "unspecified",
                "swarm_job": "",
                "swarm_stage": "",
            },
        },
        {
            "targets": ["10.0.0.2:9101"],
            "labels": {
                "swarm_role": "peer",
                "swarm_peer": "p1",
                "swarm_state": "serving",
                "swarm_job": "j-1",
                "swarm_stage": "2",
            },
        },
    ]
