"""The scheduler's `/sd` answer (the `http_sd_configs` format): the scheduler and each live peer
with a metrics port, labelled with what never changes for that target. The real Prometheus
server discovering a live swarm through it: tests/system/test_discovery.py."""

from __future__ import annotations

from scheduler.discovery import sd_targets
from swarm.proto import control_pb2 as cpb

REACHED = {"p0", "p1", "p2"}.__contains__  # the peers the dial-back reached


def test_sd_lists_the_scheduler_and_each_peer_with_a_metrics_port() -> None:
    serving = cpb.PeerAnnouncement(
        peer="p1", address="10.0.0.2:7000", metrics_address="10.0.0.2:9101", job="j-1", stage=2
    )
    serving.state = cpb.PEER_STATE_SERVING
    idle = cpb.PeerAnnouncement(
        peer="p0", address="[fd00::3]:7000", metrics_address="[fd00::3]:9101"
    )
    blind = cpb.PeerAnnouncement(peer="p2", address="10.0.0.4:7000")  # no /metrics: not listed
    groups = sd_targets("10.0.0.1:9100", [serving, idle, blind], REACHED)
    assert groups == [
        {"targets": ["10.0.0.1:9100"], "labels": {"swarm_role": "scheduler"}},
        {"targets": ["[fd00::3]:9101"], "labels": {"swarm_role": "peer", "swarm_peer": "p0"}},
        {"targets": ["10.0.0.2:9101"], "labels": {"swarm_role": "peer", "swarm_peer": "p1"}},
    ]


def test_a_peer_keeps_its_target_labels_whatever_it_does() -> None:
    """A target label that changes starts a new series of every metric of that target: a peer's
    state, job and stage are in its `swarm_peer_info` instead (stage_server/peer/metrics.py)."""
    address = "10.0.0.2:9101"
    lives = [
        cpb.PeerAnnouncement(peer="p1", metrics_address=address, state=cpb.PEER_STATE_JOINING),
        cpb.PeerAnnouncement(
            peer="p1", metrics_address=address, state=cpb.PEER_STATE_JOINING, job="j-1"
        ),
        cpb.PeerAnnouncement(
            peer="p1", metrics_address=address, state=cpb.PEER_STATE_SERVING, job="j-1", stage=0
        ),
        cpb.PeerAnnouncement(
            peer="p1", metrics_address=address, state=cpb.PEER_STATE_DRAINING, job="j-1", stage=0
        ),
        cpb.PeerAnnouncement(
            peer="p1", metrics_address=address, state=cpb.PEER_STATE_SERVING, job="j-2", stage=1
        ),
    ]
    for p in lives:
        p.address = "10.0.0.2:7000"
    answers = [sd_targets("", [p], REACHED) for p in lives]
    assert all(a == answers[0] for a in answers), answers


def test_a_relayed_peer_is_labelled_with_its_relay_for_relabelling_only() -> None:
    """A peer behind NAT is scraped through its relay (docs/prometheus.yml routes it by
    `__meta_swarm_relay`); a `__meta_` label is never stored, so changing relay splits nothing."""
    relayed = cpb.PeerAnnouncement(
        peer="p1",
        address="192.168.1.20:7001",
        metrics_address="192.168.1.20:9101",
        relay="203.0.113.5:7100",
    )
    assert sd_targets("", [relayed], REACHED) == [
        {
            "targets": ["192.168.1.20:9101"],
            "labels": {
                "swarm_role": "peer",
                "swarm_peer": "p1",
                "__meta_swarm_relay": "203.0.113.5:7100",
            },
        }
    ]


def test_only_a_peer_the_dial_back_reached_is_listed_and_only_at_its_own_host() -> None:
    """Any token holder's announcement was listed: Prometheus scraped whatever address it named
    (an internal service of the scheduler's network, say), carrying the metrics token. A peer
    is a target once the dial-back reached it at its address, and only at that address's host."""
    elsewhere = cpb.PeerAnnouncement(
        peer="p1", address="10.0.0.2:7000", metrics_address="10.0.0.9:9100"
    )
    unchecked = cpb.PeerAnnouncement(
        peer="p3", address="10.0.0.3:7000", metrics_address="10.0.0.3:9101"
    )
    no_address = cpb.PeerAnnouncement(peer="p2", metrics_address="10.0.0.4:9101")
    assert sd_targets("", [elsewhere, unchecked, no_address], REACHED) == []
