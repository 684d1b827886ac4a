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
where it attached from; counting by that is left to do). A host is one seat however its
address is written (a name's case and root dot, an IPv6 address's zeros, an IPv4 address as
IPv6 maps it); a name and the address it resolves to are still two (resolving is left to do).
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
        ip = ipaddress.ip_address(host)
    except ValueError:  # a name: as DNS compares them (a name and its address stay two)
        name = host.lower().rstrip(".")
        return name if name != "localhost" else address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # an IPv4 host as IPv6 writes it
    # One address however it is written (`2606:4700:0::1` is `2606:4700::1`)
    return str(ip) if ip.is_global else address
