"""The aggregator peers the scheduler knows of (`swarm aggregator`), from the registry's
announcements: which are present, where their PoolService is, and their link rates, for the
coordinator to append after a round's replicas (the first `contributors` members of a round
contribute; the aggregators own parts by their rates).

Pure: no I/O. An aggregator is present while its last announcement says role AGGREGATOR and
SERVING with an address (its OFFLINE one, or its will, removes it from the registry). It is never a
stage's replica: placement leaves it out (`scheduler.assignments`), and `members` never lists it
(it announces no stage).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple, TypeVar

from swarm.net.bandwidth import plausible_rate
from swarm.proto import control_pb2 as cpb

__all__ = ["MAX_AGGREGATORS", "AggregatorPeer", "offered", "present"]

T = TypeVar("T")

# The most aggregators a round is given. Each one is a member every contributor sends its part
# to, so a pool's round grows with them; past a few, one more shortens no member's part by much.
MAX_AGGREGATORS = 8


class AggregatorPeer(NamedTuple):
    peer: str
    address: str  # its PoolService, "host:port"
    upload_bytes_per_second: float  # 0: not known
    download_bytes_per_second: float

    @property
    def rate(self) -> float:
        """The one rate an owner's part is sized by: it receives every contribution and sends
        every sum, so the slower of its two links (the known one if one is not; 0: neither)."""
        known = [r for r in (self.upload_bytes_per_second, self.download_bytes_per_second) if r]
        return min(known, default=0.0)


def _rate(value: float) -> float:
    """An announced rate as the pool may use it: not finite, negative or past the ceiling, it
    is not known (the registry has already taken it so; this holds for any mapping given)."""
    return plausible_rate(value)


def present(
    peers: Mapping[str, cpb.PeerAnnouncement], limit: int = MAX_AGGREGATORS
) -> list[AggregatorPeer]:
    """The aggregators among `peers` (the registry's announcements) serving now, the fastest
    `limit` of them (by `rate`; unknown rates last), in peer order: the order every round of
    the job lists them in, whatever order their announcements came in."""
    found = [
        AggregatorPeer(
            a.peer,
            a.address,
            _rate(a.upload_bytes_per_second),
            _rate(a.download_bytes_per_second),
        )
        for a in list(peers.values())
        if a.role == cpb.PEER_ROLE_AGGREGATOR
        and a.state == cpb.PEER_STATE_SERVING
        and a.address
        and not a.relay  # behind NAT: every byte of its parts would cross its relay twice
    ]
    fastest = sorted(found, key=lambda a: (-a.rate, a.peer))[: max(limit, 0)]
    return sorted(fastest, key=lambda a: a.peer)


def offered(
    peers: Mapping[str, cpb.PeerAnnouncement],
    make: Callable[[AggregatorPeer], T],
    limit: int = MAX_AGGREGATORS,
) -> Callable[[int], list[T]]:
    """The coordinator's seam (`Groups(aggregators=...)`, helper "parts"'s): for a stage, the
    `present` aggregators, each made into the coordinator's own form by `make`, read anew at
    every round (`peers` is the registry's live dict). Every stage of a running job is offered
    the same ones: an aggregator takes parts of any stage of the jobs it follows."""
    return lambda stage: [make(a) for a in present(peers, limit)]
