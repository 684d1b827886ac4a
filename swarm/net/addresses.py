"""Network addresses: what a process binds and what it announces.

A process listens on `--host` (`0.0.0.0` or `::` to take every interface, as in a container or
behind NAT) and tells others to dial `--announce-host` (default: `--host`). An unspecified
address can be bound but never dialled, so announcing one is refused. IPv6 hosts are written in
brackets wherever a port follows (`[::1]:7700`), as gRPC targets and URLs want them.
"""

from __future__ import annotations

import ipaddress
import socket

from swarm.errors import ConfigError

__all__ = ["announced_host", "host_port", "is_unspecified", "lan_address", "peer_host"]


def _bare(host: str) -> str:
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def host_port(host: str, port: int) -> str:
    """`host:port`, an IPv6 host in brackets."""
    host = _bare(host)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def peer_host(peer: str) -> str:
    """The host of a gRPC caller as its server saw it (`context.peer()`: `ipv4:203.0.113.5:4242`,
    `ipv6:[::1]:4242`, `ipv6:%5B::1%5D:4242`); "" for any other transport (a Unix socket)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return ""
    host = rest.replace("%5B", "[").replace("%5D", "]").rpartition(":")[0]
    return _bare(host)


def is_unspecified(host: str) -> bool:
    """`host` means "every interface" (0.0.0.0, ::, or nothing): bindable, not dialable."""
    host = _bare(host.strip())
    if not host:
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False  # a host name


def announced_host(host: str, announce_host: str = "", what: str = "this process") -> str:
    """The host others dial to reach `what`, listening on `host`: `announce_host`, else `host`.
    Raises ConfigError when that is an unspecified address."""
    chosen = announce_host or host
    if is_unspecified(chosen):
        flag = "--announce-host" if announce_host else "--host"
        raise ConfigError(
            f"{flag} {chosen or '(empty)'}: {what} would announce an address nobody can dial; "
            "give --announce-host (or SWARM_ANNOUNCE_HOST) with an address other machines reach "
            "it at, and keep --host 0.0.0.0 (or ::) to listen on every interface"
        )
    return _bare(chosen)


def lan_address(toward: str) -> str:
    """This machine's own address on its LAN: the source address of its route to `toward` (a
    host: the broker's), when that is a private one (RFC 1918, IPv6 unique-local); "" otherwise
    (a public address is the operator's to announce, with --announce-host; loopback and
    link-local name no LAN). A UDP socket's connect picks the route and sends nothing, so no
    firewall sees it; a name is resolved by the system resolver, once, at start."""
    host = _bare(toward.strip())
    if not host:
        return ""
    try:
        family, _, _, _, target = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(target)
            own = ipaddress.ip_address(probe.getsockname()[0].split("%")[0])
    except (OSError, ValueError, IndexError):
        return ""
    if own.is_loopback or own.is_link_local or own.is_unspecified or not own.is_private:
        return ""
    return str(own)
