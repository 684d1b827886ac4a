"""How many peers the scheduler keeps: at most `MAX_PEERS`, whoever announces.

Any token holder may log in under a made-up id, announce it (not retained) and disconnect
cleanly, so that no last-will says it left: each such id stayed in the registry, the dial-back
checker's maps and the scheduler's retained reachability report for good, and every
announcement woke placement, which walks them all. So the peers are counted as they are first
heard, and past the bound a newcomer takes the place of a peer heard from least recently that
does nothing here but hold its place:
- never one the scheduler gave work (by its own records: a peer's word on what it serves is
  anyone's), nor a relay a present peer is reached through, nor one its dial-back reached: an
  honest peer waiting for work announces once and is silent after, and one forgotten would not
  come back (its announcement is retained on the broker, which the scheduler reads as it
  subscribes, not again);
- first one the dial-back found unreachable or with nothing to dial (a made-up id's address
  answers nobody), looked for among the next `_LOOK_PAST` candidates;
- else one not checked yet (a flood of made-up ids comes faster than their checks: each
  newcomer takes the oldest unchecked place, so an honest newcomer is checked, and kept, long
  before the flood reaches it).
With every place kept so, the newcomer is turned away, said at WARNING (rated), and waits (at
most `MAX_WAITING`, the oldest going first) for the next place a peer leaves: its announcement
is not sent again.

Pure state beside the registry (`scheduler.registry`): the scheduler asks `admit` before it
hands the registry an announcement, forgets the peers it names as if each had announced itself
offline, and offers a waiting one (`waiting`) as a place frees.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict

from scheduler.dial_findings import relays_reached
from scheduler.registry import PeerRegistry
from swarm.ops.rated import RatedLog
from swarm.proto import control_pb2 as cpb

__all__ = ["MAX_PEERS", "PeerRoom"]

log = logging.getLogger(__name__)

# Peers kept at once: a few KiB each in the scheduler (an announcement, a dial-back report, its
# retained copy), tens of MiB in all. A swarm of thousands of volunteers fits. (The embedded
# broker's retained total, `BrokerLimits.max_retained_bytes`, holds as many announcements.)
MAX_PEERS = 1 << 14
# Turned-away announcements kept for the next place that frees.
MAX_WAITING = 1024
# Candidates looked at past the first one not checked yet, for one found unreachable first.
_LOOK_PAST = 64
# After a round of every place found none to take, newcomers are turned away this long without
# another round (16,384 places looked at for each of a flood's newcomers held the event loop).
_FULL_S = 1.0
_RELAYS_S = 1.0  # how long the relays in use, as found, stand (`PeerRoom._relays_in_use`)


class PeerRoom:
    """The peers heard, least recently heard (or passed over for room) first."""

    def __init__(self, registry: PeerRegistry, cap: int = MAX_PEERS) -> None:
        self._registry, self.cap = registry, cap
        self._heard: OrderedDict[str, None] = OrderedDict()
        self._waiting: OrderedDict[str, cpb.PeerAnnouncement] = OrderedDict()
        self._turned_away = self._made_room = 0
        self._full_until = -math.inf  # till when no place may be taken (a round just found none)
        self._said = RatedLog(log)
        # `relays_in_use`, a pass over every peer: once a second at most, not for each newcomer
        # of a flood (relays come and go far more slowly)
        self._relays: tuple[float, set[str]] = (-math.inf, set())

    def __len__(self) -> int:
        return len(self._heard)

    def _relays_in_use(self, now: float) -> set[str]:
        at, relays = self._relays
        if now - at >= _RELAYS_S:
            self._relays = (now, relays := relays_in_use(self._registry))
        return relays

    def admit(self, message: cpb.PeerAnnouncement) -> list[str] | None:
        """The peers to forget so that the announcement's peer may be kept ([] for a peer kept
        already, or with room to spare, or one that left); None: no room, it is turned away."""
        peer = message.peer
        if message.state == cpb.PEER_STATE_OFFLINE:
            self._heard.pop(peer, None)
            self._waiting.pop(peer, None)
            return []
        if peer in self._heard:
            self._heard.move_to_end(peer)
            return []
        gone = []
        if len(self._heard) >= self.cap:
            freed = self._room()
            if freed is None:
                self._turn_away(message)
                return None
            gone.append(freed)
        self._heard[peer] = None
        return gone

    def waiting(self) -> cpb.PeerAnnouncement | None:
        """The oldest turned-away announcement, offered again (a place freed), if any."""
        return self._waiting.popitem(last=False)[1] if self._waiting else None

    def _room(self) -> str | None:
        """The peer whose place a newcomer takes, forgotten here; None: no place may be taken.
        Those kept go to the back as they are passed over, so that the next look starts past
        them: each is passed over once a round of the places, not once a newcomer."""
        now = self._registry.clock.now()
        if now < self._full_until:
            return None  # a whole round of the places just found none: not again at once
        registry, relays = self._registry, self._relays_in_use(now)
        unchecked: str | None = None
        looked = 0
        for _ in range(len(self._heard)):
            peer = next(iter(self._heard))
            self._heard.move_to_end(peer)
            kind = _kind(registry, relays, peer)
            if kind == _KEPT:
                continue
            if kind == _IDLE:
                unchecked = unchecked or peer
                looked += 1
                if looked <= _LOOK_PAST:
                    continue
            chosen = peer if kind == _GONE else unchecked
            break
        else:
            chosen = unchecked
        if chosen is None:
            self._full_until = now + _FULL_S
        if chosen is not None:
            del self._heard[chosen]
            self._made_room += 1
            self._said.info(
                "room",
                "peer %s forgotten to make room for a newcomer (%d so far: the scheduler keeps "
                "at most %d peers; it never reached this one, nor placed it)",
                chosen[:128],
                self._made_room,
                self.cap,
            )
        return chosen

    def _turn_away(self, message: cpb.PeerAnnouncement) -> None:
        peer = message.peer
        self._waiting.pop(peer, None)
        self._waiting[peer] = message  # its newest, at the back
        while len(self._waiting) > MAX_WAITING:
            self._waiting.popitem(last=False)
        self._turned_away += 1
        self._said.warning(
            "full",
            "the scheduler keeps at most %d peers (swarm's MAX_PEERS), each given work, a "
            "relay in use or reached by its dial-back: %s turned away until a place frees (%d "
            "so far)",
            self.cap,
            peer[:128],
            self._turned_away,
        )


_KEPT, _GONE, _IDLE = "kept", "gone", "idle"


def relays_in_use(registry: PeerRegistry) -> set[str]:
    """The relays (peer ids) some present peer was reached through by the dial-back: a peer's
    own word (its `relay`, its `relay_address`) makes no relay kept, and one address keeps one
    place, its first announcer's (a made-up id naming a relay in use is no relay)."""
    reached, holders = relays_reached(registry), dict[str, str]()
    for peer, announced in list(registry.peers.items()):  # in the order they first announced
        if announced.relay_address in reached:
            holders.setdefault(announced.relay_address, peer)
    return set(holders.values())


def _kind(registry: PeerRegistry, relays: set[str], peer: str) -> str:
    """Whether `peer`'s place may be taken: never (`_KEPT`), first (`_GONE`: forgotten by the
    registry, found unreachable, or with nothing to dial), or else (`_IDLE`: not checked yet)."""
    announced = registry.peers.get(peer)
    if announced is None:
        return _GONE  # forgotten there since: its place is free
    if registry.placed(peer) or peer in relays:
        return _KEPT  # given work, or a relay some present peer is reached through
    report = registry.reachability(peer)
    if registry.is_unreachable(peer) or not announced.address:
        return _GONE
    if report is not None and report.reachability != cpb.REACHABILITY_UNKNOWN:
        return _KEPT  # reached: an honest peer waiting for work
    return _IDLE
