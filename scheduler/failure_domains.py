"""What the scheduler knows of a peer's failure domains (`swarm.policy.domains`), from what it
announced and how it is reached (docs/decisions.md, "Failure domains"):
- its host: the `host_id` it announces (its hostname and a hash of its machine id, the same for
  every stage server on one machine); a peer that announces none, dialled directly, is known by
  the host of its address (two servers on one machine announce the same one);
- its router: the public address its traffic leaves from. A relayed peer's is the source address
  its relay saw its attachment come from (the relay tells the peer, which announces it as
  `public_address`); a directly dialled one's is the host of the address the dial-back reached
  (a forwarded port announces the router's own address). A loopback address names no router:
  such peers share a machine, which their host says.
A relayed peer that says neither is in domains of its own: its announced address is a private one
(192.168.1.10 in many homes), which says nothing of who shares its machine or router."""

from __future__ import annotations

import ipaddress

from swarm.policy.domains import Domains
from swarm.proto import control_pb2 as cpb

__all__ = ["domains_of"]


def domains_of(announcement: cpb.PeerAnnouncement, relayed: bool) -> Domains:
    """`announcement`'s peer's domains; `relayed`: calls to it go through a relay."""
    address = "" if relayed else _host(announcement.address)
    router = announcement.public_address or address
    return Domains(host=announcement.host_id or address, router="" if _loopback(router) else router)


def _host(address: str) -> str:
    """The host part of `host:port` (an IPv6 one without its brackets)."""
    host = address.rpartition(":")[0] if ":" in address else address
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name
