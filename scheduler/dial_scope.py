"""Where the dial-back may dial (issue 54, M-scan): it dials what a peer announces, so without a
scope it is a port scanner a peer aims, at the scheduler's own loopback, its LAN, or through any
relay it names. `DialScope` refuses, before any connection, an address whose host is not public
(loopback, private, link-local, shared, reserved or documentation ranges: `ipaddress`'s
`is_global`), a name resolving to one included, unless the operator allows private ranges
(`swarm scheduler --dial-private`, for a swarm on one LAN or one machine, and the tests' and
benchmarks' networks; a scheduler that itself announces a loopback or private address heads such
a swarm and allows them by itself: `private_swarm`). The relay a peer names is dialled only
under the same rule; the peer's own address behind it is the relay's to reach, among the peers
attached to it.

Only a plain `host:port` is dialled (issue 64, item 6): gRPC takes `ipv4:127.0.0.1:P`,
`dns:///…` and `unix:/path` as targets too, which the host check read as names resolving nowhere
and let through, to the scheduler's own loopback or a Unix socket, its token included. And a
failed dial's report is paced (`scheduler.reachability`): it comes no sooner than a silent
host's would, so its timing does not tell a closed port from a filtered one.

`DialPace` spaces one peer's checks: a peer changing its announced address or relay at every
announcement is checked at most once per `min_interval_s`, so it cannot make the scheduler dial
faster than that.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket

__all__ = ["NOT_DIALLED", "PACE_S", "DialPace", "DialScope", "plain", "private_swarm"]

PACE_S = 5.0  # seconds between two checks of one peer, by default (`DialPace`)
# The longest host:port dialled: a bracketed IPv6 address with a zone, or a 253-character name,
# and a port
MAX_ADDRESS_CHARS = 261

NOT_DIALLED = "not dialled"  # how a refusal's text begins (`scheduler.dial_causes`)
# host:port and nothing else: a bracketed IPv6 address, or a name or IPv4 address of letters,
# digits, dots and hyphens; a port number; no scheme, path or second colon (and no service name:
# `dns:localhost` would be one, to gRPC a target of its own)
_PLAIN = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?):([0-9]{1,5})")


class DialScope:
    """Which hosts the dial-back may dial: public ones, and private ranges only with
    `allow_private` (the operator's --dial-private)."""

    def __init__(self, allow_private: bool = False) -> None:
        self.allow_private = allow_private

    async def refuses(self, address: str) -> str | None:
        """None when `address` ("host:port") may be dialled; else why not, in words beginning
        with `NOT_DIALLED`. Only a plain `host:port` (`plain`), whatever the scope. A name is
        resolved here (a name that resolves nowhere is dialled: the dial says it fails)."""
        if not plain(address):
            shown = address[:80].encode("unicode_escape").decode()[:80]
            return f"{NOT_DIALLED}: {shown!r} is not host:port (a name or an address, and a port)"
        if self.allow_private:
            return None
        host = address.rpartition(":")[0].strip("[]")
        try:
            found = [ipaddress.ip_address(host)]
        except ValueError:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(
                    host, None, type=socket.SOCK_STREAM
                )
            except (OSError, UnicodeError):  # resolves nowhere: the dial says it fails
                return None
            found = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
        private = [ip for ip in found if not ip.is_global]
        if not private:
            return None
        return (
            f"{NOT_DIALLED}: {host} is a private address ({private[0]}), and this scheduler "
            "dials only public ones (--dial-private allows private ranges)"
        )


def plain(address: str) -> bool:
    """Whether `address` is a plain `host:port` (a port 1-65535), which gRPC dials as such: a
    name of at most 253 characters in labels of 1-63 (DNS's bounds: the resolver refuses
    others with UnicodeError, not as a name that resolves nowhere)."""
    if len(address) > MAX_ADDRESS_CHARS:
        return False
    match = _PLAIN.fullmatch(address)
    if match is None or not 0 < int(match.group(2)) < 65536:
        return False
    host = match.group(1)
    return host.startswith("[") or (
        len(host) <= 253 and all(0 < len(label) < 64 for label in host.split("."))
    )


def private_swarm(announced_host: str) -> bool:
    """Whether a scheduler announced at `announced_host` heads a swarm of one machine or one LAN
    (a loopback or private address, `localhost`): its peers' addresses are private too, and
    nothing it could be aimed at lies outside the network it already shares with them, so its
    dial-back may dial private ranges without --dial-private. A public address or a name (a
    swarm others join from the internet) keeps the dial-back to public addresses."""
    host = announced_host.strip("[]")
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False  # a name: the swarm's public face
    return not ip.is_global and not ip.is_unspecified


class DialPace:
    """When each peer may next be dialled: `min_interval_s` after its last check began, but for
    its `first_relay`, once a peer id.

    That is a peer behind NAT not started `--behind-nat` (nor from an invite that says so): a
    check found it unreachable at its address, it attached to a relay on that report and
    announced it there. Paced from that check's start, it read relayed 8.5-9.9 s after its
    start (6.2-6.5 s unpaced). The pace keeps a peer from making the scheduler dial as often as
    it announces; once a peer id gives a token holder no more dials than a new peer id does
    (checked at once too, and free to make up)."""

    def __init__(self, min_interval_s: float) -> None:
        self.min_interval_s = min_interval_s
        self._last: dict[str, float] = {}
        self._unpaced: set[str] = set()  # peers whose first relay was checked at once

    def earliest(self, peer: str, now: float, first_relay: bool = False) -> float:
        if first_relay and peer not in self._unpaced:
            self._unpaced.add(peer)
            return now
        last = self._last.get(peer)
        return now if last is None else max(now, last + self.min_interval_s)

    def began(self, peer: str, now: float) -> None:
        self._last[peer] = now

    def forget(self, peer: str) -> None:
        self._last.pop(peer, None)
        self._unpaced.discard(peer)
