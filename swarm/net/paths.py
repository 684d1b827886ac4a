"""The one place that knows how a peer's dial address is written: plain `host:port`, or relayed.

A peer behind NAT announces its own address (`host:port`, what its TLS certificate names) and is
reached through a relay it attached to. Its dial address says all three:
`relay://PEER@RELAY/ADDRESS`, e.g. `relay://home-gpu-1@203.0.113.5:7100/192.168.1.20:7001`.
`swarm.net.dial.channel` dials such an address through the relay (an HTTP CONNECT to ADDRESS,
authenticated for PEER with `relay_credential`) and verifies the peer's certificate against
ADDRESS's host, as a direct dial would. Pure: no I/O, nothing resolved.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

__all__ = ["SCHEME", "Path", "parse", "relay_credential", "relayed_address"]

SCHEME = "relay://"


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
