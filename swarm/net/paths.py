"""The one place that knows how a peer's dial address is written: plain `host:port`, or relayed.

A peer behind NAT announces its own address (`host:port`, what its TLS certificate names) and is
reached through a relay it attached to. Its dial address says all three:
`relay://PEER@RELAY/ADDRESS`, e.g. `relay://home-gpu-1@203.0.113.5:7100/192.168.1.20:7001`.
`swarm.net.dial.channel` dials such an address through the relay (an HTTP CONNECT to ADDRESS,
authenticated for PEER with `relay_credential`) and verifies the peer's certificate against
its identity, `peer_name(PEER)` (`PEER.peer.swarm`), not against ADDRESS's host: a NAT'd peer's
address is private or loopback, the same in many homes, so it names nobody; its id is its own, and
the relay delivers the call to that id. `swarm certs issue NAME --peer PEER` issues a certificate
naming it. Pure: no I/O, nothing resolved.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

__all__ = [
    "PEER_DOMAIN",
    "SCHEME",
    "Path",
    "parse",
    "peer_name",
    "relay_credential",
    "relayable",
    "relayed_address",
]

SCHEME = "relay://"
PEER_DOMAIN = "peer.swarm"
"""Where peer ids are names: `PEER.peer.swarm`, a domain no real host is in, so a peer's name
never stands for a host others dial directly (nor a host's for a peer)."""


def peer_name(peer: str) -> str:
    """The name a relayed peer's TLS certificate must carry (a DNS subject alternative name), and
    what its callers verify it by: `PEER.peer.swarm`, lower-cased (names match regardless of
    case)."""
    if not peer or "@" in peer or "/" in peer:
        raise ValueError(f"peer id {peer!r} cannot name a peer (empty, '@' or '/')")
    return f"{peer.lower()}.{PEER_DOMAIN}"


@dataclass(frozen=True)
class Path:
    """How to reach an address: `target` (`host:port`, dialled directly when `relay` is None, else
    asked of the relay), through `relay` (`host:port`), to `peer` (the id the relay knows it by)."""

    target: str
    relay: str | None = None
    peer: str | None = None


def relayed_address(peer: str, address: str, relay: str) -> str:
    """The dial address of `peer`, announced at `address`, reached through relay `relay`."""
    if not peer or "@" in peer or "/" in peer:
        raise ValueError(f"peer id {peer!r} cannot name a relayed peer (empty, '@' or '/')")
    if not address or not relay or "/" in relay or "@" in relay:
        raise ValueError(f"cannot relay to {address!r} through {relay!r}")
    return f"{SCHEME}{peer}@{relay}/{address}"


def relayable(peer: str, address: str, relay: str) -> str | None:
    """`relayed_address`, or None where none can be written (a peer id or relay with '@' or
    '/', no address): what a peer announces is any token holder's to send, and a lookup that
    raised ended whatever read it (every job's stall watch read every peer's)."""
    try:
        return relayed_address(peer, address, relay)
    except ValueError:
        return None


def parse(address: str) -> Path:
    """The path an address names; a plain `host:port` parses to `Path(address)` (no relay).
    ValueError for a relayed address missing a part."""
    if not address.startswith(SCHEME):
        return Path(address)
    authority, slash, target = address[len(SCHEME) :].partition("/")
    peer, at, relay = authority.partition("@")
    if not (slash and at and peer and relay and target):
        raise ValueError(
            f"relayed address {address!r} is not {SCHEME}PEER@RELAY_HOST:PORT/PEER_HOST:PORT"
        )
    return Path(target, relay, peer)


def relay_credential(token: str | None, peer: str) -> str:
    """The password of a tunnel to `peer` ("" without a token), derived from the swarm token: a
    caller shows it to the relay (its CONNECT's `Proxy-Authorization`, user `peer`), which
    checks it (`swarm.relay.auth` has the relay's other credentials). One leaked from one caller
    opens tunnels to `peer` only, and `peer` still checks the caller's own token and TLS."""
    if not token:
        return ""
    return hmac.new(token.encode(), f"relay:{peer}".encode(), hashlib.sha256).hexdigest()
