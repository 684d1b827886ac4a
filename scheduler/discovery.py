"""Prometheus service discovery: what the scheduler answers at `/sd` on its metrics port, in the
`http_sd_configs` format (a JSON list of target groups), so one Prometheus job finds the
scheduler and every live peer as they come and go (docs/prometheus.yml uses it).

Each peer is a target of its own, labelled with its role and peer id only: what never changes for
that target. A target label that changes (a state, a job, a stage) would start a new series of
every metric the target serves at each change, and split one peer in two for `rate()` and `sum`;
what a peer does now is in its metric `swarm_peer_info{peer,state,job,stage}` instead. A peer
without a metrics port is not listed, nor one the scheduler's dial-back has not reached at its
address, nor a metrics address on another host than that address. The labels are prefixed
`swarm_`: the series themselves carry `job`, `stage` and `peer` (kept with `honor_labels:
true`).

A peer reached through a relay (behind NAT: its announcement names the relay) is labelled
`__meta_swarm_relay` with the relay's address too: Prometheus scrapes it through that relay (the
relay's scrape job, `proxy_url`), the other jobs drop it (docs/prometheus.yml). A `__meta_` label
is seen by relabelling only, never stored, so a peer that changes relay stays one series.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from swarm.proto import control_pb2 as cpb

__all__ = ["CONTENT_TYPE", "sd_document", "sd_targets"]

CONTENT_TYPE = "application/json"


def sd_targets(
    scheduler: str, peers: list[cpb.PeerAnnouncement], reached: Callable[[str], bool]
) -> list[dict[str, object]]:
    """Target groups: the scheduler's metrics address (`scheduler`, "" when it serves none) and
    each announced peer's that the dial-back `reached` at its address, at that address's host
    (a peer serves its /metrics beside its gRPC server): a token holder's word alone pointed
    Prometheus, and its metrics token, at any address it named."""
    groups: list[dict[str, object]] = []
    if scheduler:
        groups.append({"targets": [scheduler], "labels": {"swarm_role": "scheduler"}})
    for p in sorted(peers, key=lambda p: p.peer):
        if not p.metrics_address or not reached(p.peer):
            continue
        if not p.address or _host(p.metrics_address) != _host(p.address):
            continue
        labels = {"swarm_role": "peer", "swarm_peer": p.peer}
        if p.relay:
            labels["__meta_swarm_relay"] = p.relay
        groups.append({"targets": [p.metrics_address], "labels": labels})
    return groups


def sd_document(
    scheduler: str, peers: list[cpb.PeerAnnouncement], reached: Callable[[str], bool]
) -> tuple[str, bytes]:
    """The `/sd` answer: (content type, body)."""
    return CONTENT_TYPE, json.dumps(sd_targets(scheduler, peers, reached)).encode()


def _host(address: str) -> str:
    return address.rpartition(":")[0]
