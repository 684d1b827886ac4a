"""What the scheduler's own dial-back found of the peers (`scheduler.reachability`), asked where
a peer's word must not be enough: the relays kept in the scheduler's room (`scheduler.peer_room`)
and the peers `/sd` points Prometheus at (`scheduler.discovery`)."""

from __future__ import annotations

from scheduler.registry import PeerRegistry
from swarm.proto import control_pb2 as cpb

__all__ = ["relays_reached", "was_reached"]

_REACHED = (cpb.REACHABILITY_DIRECT, cpb.REACHABILITY_RELAYED)


def relays_reached(registry: PeerRegistry) -> set[str]:
    """The relays (their listeners' `host:port`) the dial-back reached some present peer
    through: the scheduler's own finding, not a peer's word."""
    found = (registry.reachability(peer) for peer in list(registry.peers))
    return {r.relay for r in found if r and r.reachability == cpb.REACHABILITY_RELAYED and r.relay}


def was_reached(registry: PeerRegistry, peer: str) -> bool:
    """Whether the dial-back reached `peer` at the address it announces now, directly or through
    its relay (a report of an address it announced before is not: it names another host). Safe
    on the metrics thread: a read of two dicts."""
    report, announced = registry.reachability(peer), registry.peers.get(peer)
    return (
        report is not None
        and announced is not None
        and report.reachability in _REACHED
        and report.address == announced.address
    )
