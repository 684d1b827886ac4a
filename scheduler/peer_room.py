"""How many peers the scheduler keeps: at most `MAX_PEERS`, whoever announces.

Any token holder may log in under a made-up id, announce it (not retained) and disconnect
cleanly, so that no last-will says it left: each such id stayed in the registry, the dial-back
checker's maps and the scheduler's retained reachability report for good, and every
announcement woke placement, which walks them all. So the peers are counted as they are first
heard. Past the bound a newcomer gets the place of the peer heard from least recently that
nobody can dial (its dial-back found it unreachable) and that the scheduler never placed: a
made-up id's address answers nobody, and such a peer does nothing here but fill its place. With
no such peer the newcomer is turned away, said at WARNING (rated): the places are all taken by
peers that serve, wait reachable for work, or are not checked yet (a flood of made-up ids
before their checks end turns honest newcomers away too, and says so).

Pure state beside the registry (`scheduler.registry`): the scheduler asks `admit` before it
hands the registry an announcement, and forgets the peers it names as if each had announced
itself offline.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from scheduler.registry import PeerRegistry
from swarm.ops.rated import RatedLog
from swarm.proto import control_pb2 as cpb

__all__ = ["MAX_PEERS", "PeerRoom"]

log = logging.getLogger(__name__)

# Peers kept at once: a few KiB each in the scheduler (an announcement, a dial-back report, its
# retained copy), tens of MiB in all. A swarm of thousands of volunteers fits.
MAX_PEERS = 1 << 14


class PeerRoom:
    """The peers heard, least recently heard (or passed over for room) first."""

    def __init__(self, registry: PeerRegistry, cap: int = MAX_PEERS) -> None:
        self._registry, self.cap = registry, cap
        self._heard: OrderedDict[str, None] = OrderedDict()
        self._turned_away = 0
        self._said = RatedLog(log)

    def __len__(self) -> int:
        return len(self._heard)

    def admit(self, message: cpb.PeerAnnouncement) -> list[str] | None:
        """The peers to forget so that the announcement's peer may be kept ([] for a peer kept
        already, or with room to spare, or one that left); None: no room, it is turned away."""
        peer = message.peer
        if message.state == cpb.PEER_STATE_OFFLINE:
            self._heard.pop(peer, None)
            return []
        if peer in self._heard:
            self._heard.move_to_end(peer)
            return []
        gone = []
        if len(self._heard) >= self.cap:
            freed = self._room()
            if freed is None:
                self._turn_away(peer)
                return None
            gone.append(freed)
        self._heard[peer] = None
        return gone

    def _room(self) -> str | None:
        """The peer whose place a newcomer takes, forgotten here; None: no place may be taken.
        Those passed over go to the back, so that the next look starts past them."""
        registry = self._registry
        for _ in range(len(self._heard)):
            peer = next(iter(self._heard))
            gone = peer not in registry.peers  # forgotten there since: its place is free
            if gone or (registry.is_unreachable(peer) and not registry.placed(peer)):
                del self._heard[peer]
                return peer
            self._heard.move_to_end(peer)
        return None

    def _turn_away(self, peer: str) -> None:
        self._turned_away += 1
        self._said.warning(
            "full",
            "the scheduler keeps at most %d peers (swarm's MAX_PEERS), each serving, waiting "
            "reachable for work, or not checked yet: %s turned away (%d so far; a flood of "
            "made-up peer ids?)",
            self.cap,
            peer[:128],
            self._turned_away,
        )
