"""What a relay holds at once (`RelayLimits`), in all and per source address, sized to fit the
descriptors its process may open (`RelayLimits.sized`, `raise_nofile`).

Every connection a relay holds is a descriptor: a request head being read, an attached peer's
control connection, a tunnel's six (the caller's and the peer's data connection, and the two
pipes its copy threads splice through, `swarm.relay.copier`). A relay whose
limits add up to more than its process's `RLIMIT_NOFILE` can be made to run out of them, and a
process out of descriptors accepts nothing, a stage server's own calls included under `--relay`.
So the soft limit is raised to the hard one at start, and the limits are lowered to fit it.

Per source, so that no one network's connections take what every other's need: heads,
attached peers, and tunnels as the caller, in all and to each peer. A source is a public IPv4
address's /24 or a public IPv6 address's /56 (what one home or one hosting subnet holds; issue
64: a home's /56 held 256 sources of a /64 each, and eight or nine addresses of one subnet
filled a relay's heads and places); a loopback or private address (one operator's machines, a
test's) is one of its own, an IPv6 one by its /64. And a source opens at most
`max_tunnels_per_peer_per_source` of one peer's tunnels (issue 64: one token holder's 64
channels calling `Info` held all of a NAT'd peer's, and the scheduler's dial-back got 503 five
times in five).

Heads the relay expects (a peer's data connection for a call it asked for) are counted apart,
and given the longer time: a flood of strangers' connections does not delay a call's data
connection, and a stranger's silent connection is dropped sooner.
"""

from __future__ import annotations

import ipaddress
import resource
from collections import Counter
from dataclasses import dataclass, replace

__all__ = [
    "METRICS_TUNNELS",
    "PEER_TUNNEL_DESCRIPTORS",
    "RESERVED_DESCRIPTORS",
    "TUNNEL_DESCRIPTORS",
    "V4_PREFIX",
    "V6_PREFIX",
    "RelayLimits",
    "nofile",
    "raise_nofile",
    "release",
    "source_of",
    "tunnels_within",
]

TUNNEL_DESCRIPTORS = 6
"""What one tunnel holds open: its two connections and its two copy threads' pipes (two ends
each). A tunnel also holds two threads, so the tunnel caps bound the relay's threads too."""


METRICS_TUNNELS = 4
"""Scrapes of one peer's /metrics carried at once, apart from its gRPC calls: the relay's
bound (`RelayLimits.max_metrics_tunnels_per_peer`) and the peer's own (`Attachment`)."""


@dataclass(frozen=True)
class RelayLimits:
    max_peers: int = 256  # peers attached at once
    max_peers_per_source: int = 32  # attached from one source (one home's router, say)
    max_tunnels_per_peer: int = 64  # a peer's concurrent tunnels (a gRPC channel uses one)
    # a peer's tunnels to its /metrics, apart: the metrics credential is handed to whoever
    # scrapes (a scrape takes one), and its tunnels took the places of the peer's callers
    max_metrics_tunnels_per_peer: int = METRICS_TUNNELS
    max_tunnels: int = 1024  # tunnels in all (six descriptors and two threads each)
    max_tunnels_per_source: int = 256  # opened by one caller's source
    max_tunnels_per_peer_per_source: int = 16  # of one peer's, opened by one caller's source
    max_heads: int = 128  # connections still sending their request head
    max_heads_per_source: int = 16
    head_timeout_s: float = 4.0  # to send a request head (and an attach's proof)
    data_timeout_s: float = 10.0  # an expected data connection's head
    max_head_bytes: int = 8192
    open_timeout_s: float = 10.0  # for the peer to open a tunnel's data connection
    probe_s: float = 5.0  # a live attachment answers a ping within this, or is replaced
    ping_s: float = 10.0  # how often an attached peer is pinged
    dead_after_s: float = 35.0  # an attached peer silent this long is dropped
    chunk_bytes: int = 256 * 1024  # a splice's read and pipe: with the sockets', its memory

    def sized(self, nofile: int) -> RelayLimits:
        """These limits, lowered where they would not fit `nofile` descriptors: a quarter (at
        least 64) is left to the process's own, the rest shared by heads (an eighth), attached
        peers (an eighth) and tunnels (`TUNNEL_DESCRIPTORS` each); no source takes more than a
        quarter of any."""
        spare = max(16, nofile - max(64, nofile // 4))
        heads = max(2, min(self.max_heads, spare // 8))
        peers = max(1, min(self.max_peers, spare // 8))
        tunnels = max(1, min(self.max_tunnels, (spare - heads - peers) // TUNNEL_DESCRIPTORS))

        def share(limit: int, of: int) -> int:
            return max(1, min(limit, of if of < 8 else of // 4))

        return replace(
            self,
            max_heads=heads,
            max_heads_per_source=share(self.max_heads_per_source, heads),
            max_peers=peers,
            max_peers_per_source=share(self.max_peers_per_source, peers),
            max_tunnels=tunnels,
            max_tunnels_per_source=share(self.max_tunnels_per_source, tunnels),
        )


#: Descriptors one call carried to a peer behind NAT takes at that peer: its data connection to
#: the relay, its connection to the peer's own server and the server's end of it, and its two
#: copy threads' pipes (`TUNNEL_DESCRIPTORS`'s four): seven, and one to spare.
PEER_TUNNEL_DESCRIPTORS = 8
#: Descriptors such a peer keeps for all else: its server's direct callers, its bus, its files.
RESERVED_DESCRIPTORS = 512


def tunnels_within(nofile: int, most: int = 256) -> int:
    """The calls a peer behind NAT carries at once through its relay (at most `most`) within
    `nofile` descriptors, `RESERVED_DESCRIPTORS` of them kept for all else: at 1,024 (a usual
    soft limit) 256 calls took some 1,800, and the peer's own accepts, checkpoints and bus
    failed for want of one."""
    return max(1, min(most, (nofile - RESERVED_DESCRIPTORS) // PEER_TUNNEL_DESCRIPTORS))


def raise_nofile() -> int:
    """Raise this process's soft `RLIMIT_NOFILE` to its hard limit (1,024 is a common soft
    limit under a far higher hard one); the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # left as it is: the limits are sized to it
    return soft


def nofile() -> int:
    """This process's soft `RLIMIT_NOFILE` now."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


V4_PREFIX = 24  # a public IPv4 source: its /24 (one subnet, where one operator's addresses sit)
V6_PREFIX = 56  # a public IPv6 source: its /56 (one home's delegation; a machine holds a /64)


def source_of(peername: object) -> str:
    """The source a connection is counted under: a public IPv4 address's /24, a public IPv6
    address's /56 (`V4_PREFIX`, `V6_PREFIX`); any other (loopback, a LAN's: one operator's
    machines, told apart) its IPv4 address or its IPv6 address's /64; "" when unknown."""
    if not isinstance(peername, tuple) or not peername:
        return ""
    try:
        address = ipaddress.ip_address(str(peername[0]).split("%")[0])
    except ValueError:
        return ""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    v6 = isinstance(address, ipaddress.IPv6Address)
    if address.is_global:
        return str(
            ipaddress.ip_network(f"{address}/{V6_PREFIX if v6 else V4_PREFIX}", strict=False)
        )
    return str(ipaddress.ip_network(f"{address}/64", strict=False)) if v6 else str(address)


def release(tally: Counter[str], key: str) -> None:
    """One fewer under `key` in a tally of sources, forgotten at none: it holds only the sources
    that hold something now."""
    tally[key] -= 1
    if tally[key] <= 0:
        del tally[key]
