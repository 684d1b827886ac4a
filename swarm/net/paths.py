"""STAND-IN (helper "reach"): the minimal `swarm.net.paths` of the shared contract, so that the
scheduler's reachability runs on this branch; helper "relay" owns the real module, which replaces
this one. The one place that knows the address form of a relayed peer."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Path", "parse", "relayed_address"]

_SCHEME = "relay://"


@dataclass(frozen=True, slots=True)
class Path:
    target: str  # the peer's own announced "host:port"
    relay: str | None  # the relay's "host:port" it is reached through; None: dialled directly
    peer: str | None  # the peer's id (what the relay knows it by); None: dialled directly


def relayed_address(peer: str, address: str, relay: str) -> str:
    """The dial address of `peer`, announced at `address`, reached through relay `relay`."""
    return f"{_SCHEME}{relay}/{peer}@{address}"


def parse(address: str) -> Path:
    """A dial address as a `Path`; a plain "host:port" has no relay."""
    if not address.startswith(_SCHEME):
        return Path(address, None, None)
    relay, _, rest = address[len(_SCHEME) :].partition("/")
    peer, _, target = rest.partition("@")
    return Path(target, relay, peer)
