"""Which peers sit behind this peer's router: those whose relays saw them come from the public
address this peer's relay saw it come from (their announcements' `public_address`). Only a
neighbour's announced LAN address is worth probing (`swarm.rpc.lan`, issue 64 item 6): anywhere
else that address is a stranger's word, and the probe would carry the swarm's token to whatever
answers there."""

from __future__ import annotations

from collections import OrderedDict

from swarm.proto import control_pb2 as cpb

__all__ = ["MAX_PUBLIC", "Neighbours"]

MAX_PUBLIC = 4096
"""Peers whose public address is remembered, the latest announced: every peer's announcement
arrives, made-up ones included, so this bounds the memory."""


class Neighbours:
    """The public address each peer last announced (while not offline)."""

    def __init__(self) -> None:
        self._public: OrderedDict[str, str] = OrderedDict()

    def heard(self, announcement: cpb.PeerAnnouncement) -> None:
        peer = announcement.peer
        self._public.pop(peer, None)
        if announcement.public_address and announcement.state != cpb.PEER_STATE_OFFLINE:
            self._public[peer] = announcement.public_address
            while len(self._public) > MAX_PUBLIC:  # the oldest go first
                self._public.popitem(last=False)

    def share(self, own: str, peer: str) -> bool:
        """Whether `peer` was seen at `own`, this peer's public address ("": none, no one)."""
        return bool(own) and self._public.get(peer) == own
