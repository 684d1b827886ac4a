"""A round's group as the coordinator builds it (`Groups`): a stage's replicas, which contribute
their gradients, then the aggregators offered to the job, which only own parts; each member's part
sized by water-filling over the members' links (`swarm.policy.parts`), once per round, and sent
with every PREPARE as one `Parts` value, so that every member cuts the same parts
(`StageCommitRequest.part_weights`, `contributors`).

A link is what a peer announced (`PeerAnnouncement.upload_bytes_per_second` and
`download_bytes_per_second`, measured from its own transfers or set with `--bandwidth`): one
full-duplex rate, its upload (`link_of` says why). A relayed peer (behind NAT) owns nothing:
every byte it owned would cross its relay twice. An aggregator that a member named as the one it
failed on takes part in no round for `shun_s`: a dead one would fail every retry meanwhile.
Rates are the registry's, checked where they entered (`swarm.net.bandwidth.plausible_rate`), and
no member owns more than `swarm.policy.parts.MAX_SHARE` / n of the vector whatever its rate; a
partition that still cannot be made is equal parts, never a failed round.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from swarm.clock import Clock, MonotonicClock
from swarm.errors import InvalidArgument
from swarm.policy.parts import EQUAL_PARTS, Parts, water_fill
from swarm.proto import control_pb2 as cpb
from swarm.rpc.lease import Replica

__all__ = ["Aggregator", "Groups", "Link", "RoundGroup", "link_of"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Link:
    """A member's link as the partition sees it: `rate`, bytes/s each way (0: unknown), and
    whether it is `relayed` (it then owns no part)."""

    rate: float = 0.0
    relayed: bool = False


def link_of(announcement: cpb.PeerAnnouncement | None) -> Link:
    """The link a peer announced: its upload rate (its download rate when no upload is known),
    and whether it is reached through a relay.

    Upload, not the lower of the two: a round's time is its members' sending (each sends what it
    receives), the uplink is the scarce side of a home link, and a download measured during a
    round is a lower bound held down by the slowest sender (`stage_server.peer.links`), so the
    lower of the two would make every member look as slow as the slowest."""
    if announcement is None:
        return Link()
    up, down = announcement.upload_bytes_per_second, announcement.download_bytes_per_second
    return Link(up if up > 0 else max(down, 0.0), bool(announcement.relay))


@dataclass(frozen=True)
class Aggregator:
    """A peer that owns parts of a job's rounds without a gradient: its PoolService `address`."""

    peer: str
    address: str
    link: Link = field(default_factory=Link)


@dataclass(frozen=True)
class RoundGroup:
    """One round's group: `members`' PoolService addresses (the replicas in their order, then
    `aggregators`) and its `parts` (their weights, empty: equal parts; how many contributors,
    0: every member). `peers`: the members' peer ids in the same order, which each member's
    round ticket names (`swarm.net.round_tickets`)."""

    members: tuple[str, ...]
    parts: Parts = EQUAL_PARTS
    aggregators: tuple[Aggregator, ...] = ()
    peers: tuple[str, ...] = ()


EQUAL = RoundGroup(())

# Per peer id, its link (`link_of` of its last announcement).
Links = Callable[[str], Link]
# The aggregators offered to the job's pool of a stage now.
Aggregators = Callable[[int], Sequence[Aggregator]]


def _no_aggregators(stage: int) -> Sequence[Aggregator]:
    return ()


class Groups:
    """How each round's group is made. `links(peer)`: a peer's link (default: none known);
    `aggregators(stage)`: the aggregators offered to the stage's pool (default: none)."""

    def __init__(
        self,
        links: Links | None = None,
        aggregators: Aggregators | None = None,
        *,
        clock: Clock | None = None,
        shun_s: float = 60.0,
    ) -> None:
        self.links: Links = links or (lambda peer: Link())
        self.aggregators: Aggregators = aggregators or _no_aggregators
        self.clock, self.shun_s = clock or MonotonicClock(), shun_s
        self._shunned: dict[str, float] = {}  # aggregator address -> until when

    def of(self, stage: int, replicas: Sequence[Replica]) -> RoundGroup:
        """The group of a round of `stage`'s pool of `replicas` (in their order)."""
        addresses = [r.address for r in replicas]
        now = self.clock.now()
        self._shunned = {a: t for a, t in self._shunned.items() if t > now}
        aggregators: list[Aggregator] = []
        for a in self.aggregators(stage):
            if a.address in self._shunned or a.address in addresses:
                continue
            if a.address not in (b.address for b in aggregators):
                aggregators.append(a)
        members = tuple(addresses) + tuple(a.address for a in aggregators)
        peers = tuple(r.peer for r in replicas) + tuple(a.peer for a in aggregators)
        if len(replicas) <= 1:  # alone: nothing to average, nothing to own
            return RoundGroup(tuple(addresses), peers=peers[: len(replicas)])
        links = [self.links(r.peer) for r in replicas] + [a.link for a in aggregators]
        relayed = {i for i, link in enumerate(links) if link.relayed}
        try:
            weights = water_fill([link.rate for link in links], len(replicas), clients=relayed)
        except InvalidArgument as e:  # a rate no check caught: equal parts, not a failed job
            log.warning("stage %d: equal parts (%s)", stage, e)
            weights = [1.0 / len(members)] * len(members)
        contributors = len(replicas) if aggregators else 0
        parts = Parts((), contributors) if len(set(weights)) == 1 else Parts(weights, contributors)
        return RoundGroup(members, parts, tuple(aggregators), peers)  # equal weights: none

    def blame(
        self, groups: Mapping[int, RoundGroup], accusations: Mapping[int, Mapping[int, set[int]]]
    ) -> list[str]:
        """A failed round: the aggregators its members named (`accusations`, per stage: accuser
        -> the group indices it failed on) sit out the next rounds; their peer ids."""
        named = []
        for stage, accused in accusations.items():
            group = groups.get(stage)
            if group is None or not group.aggregators:
                continue
            first = len(group.members) - len(group.aggregators)
            for i in sorted({i for names in accused.values() for i in names}):
                if first <= i < len(group.members):
                    a = group.aggregators[i - first]
                    self._shunned[a.address] = self.clock.now() + self.shun_s
                    named.append(a.peer)
        return named
