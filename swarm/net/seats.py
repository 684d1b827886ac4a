"""Which machine a peer's seat is on, as far as the swarm can tell without a credential (issue 64,
item 4): the host it is dialled at. With the shared token a peer's id is its own choice, and the
failure-domain fields it announces (host id, router) too; the address the scheduler's dial-back
reached it at is not. Two ids of one token holder on one machine share it, so they count as one
host's seats: a stage holds at most `MAX_SEATS` of them (`scheduler.assignments`), and a
conviction resting on one host's seats alone convicts no one (`scheduler.coordinator.trust.bans`).
Only a public (global) address names a host here: loopback and private addresses are told apart
by port (a test's swarm on one machine, a LAN's multi-GPU box: peers of one operator, not a
stranger's ids). A multi-GPU machine at a public address serves one replica of a stage. A
relayed peer's address names its relay, not its machine: it is a seat of its own (the relay sees
where it attached from; counting by that is left to do).
"""

from __future__ import annotations

import ipaddress

__all__ = ["MAX_SEATS", "seat"]

MAX_SEATS = 1  # seats of one host in one stage: two could outvote a third in its audits


def seat(address: str, peer: str = "") -> str:
    """The host `address` (`host:port`, an IPv6 host in brackets) is on, where it is a public
    one (a name too: it resolves to one); any other address whole; without a plain address
    (none, or a relayed one), the peer's id (a seat of its own)."""
    host, colon, _ = address.rpartition(":")
    if not colon or not host or "/" in address or "@" in address:
        return f"peer {peer}"
    host = host.strip("[]")
    try:
        public = ipaddress.ip_address(host).is_global
    except ValueError:
        public = host != "localhost"
    return host if public else address
