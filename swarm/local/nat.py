"""A home router of the namespace lab (`swarm.local.netns`): a private LAN behind one public
address. The router masquerades the LAN's connections out and, like a home router, drops every
connection that starts outside: its nftables ruleset forwards only the LAN's new connections and
what belongs to an established one, and takes none addressed to itself from the public side.
This module says what a router is (its addresses, its ruleset) and reads its drop counters; the
lab (`netns.Network`) builds it.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["LAN_DEV", "TABLE", "WAN_DEV", "Lan", "dropped_packets", "ruleset"]

WAN_DEV = "eth0"  # the router's leg on the public bridge
LAN_DEV = "eth1"  # its leg on the LAN's bridge
TABLE = "swarm_lab"  # the router's nftables table (family ip)


@dataclass(frozen=True)
class Lan:
    """A private LAN (`subnet`, a /24 or smaller) behind router `router`, whose public leg has
    address `public` on the lab's public bridge and whose LAN leg is the subnet's first address
    (the LAN hosts' default route). `hosts`: each LAN host's address in the subnet."""

    router: str
    public: str
    subnet: str
    hosts: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        net = ipaddress.IPv4Network(self.subnet)  # raises ValueError on a malformed subnet
        ipaddress.IPv4Address(self.public)
        if net.prefixlen < 24 or net.prefixlen > 30:
            raise ValueError(f"LAN {self.subnet}: use a /24 to a /30")
        if ipaddress.IPv4Address(self.public) in net:
            raise ValueError(f"router {self.router}'s public address {self.public} is in its LAN")
        for host, address in self.hosts.items():
            if ipaddress.IPv4Address(address) not in net or address == self.gateway:
                raise ValueError(
                    f"LAN host {host}'s address {address} must be in {self.subnet}, "
                    f"other than the router's {self.gateway}"
                )

    @property
    def gateway(self) -> str:
        """The router's address on the LAN: the subnet's first host address."""
        return str(next(ipaddress.IPv4Network(self.subnet).hosts()))

    @property
    def prefixlen(self) -> int:
        return ipaddress.IPv4Network(self.subnet).prefixlen


def ruleset(lan: Lan) -> str:
    """The router's nftables ruleset (`nft -f -`). Forwarding drops by default: only what the
    LAN starts goes out (masqueraded as the router's public address) and only its answers
    come back (conntrack: established or related), so a public host that routes to the LAN
    anyway reaches nobody. The explicit final drops count what they drop (`dropped_packets`)."""
    net = ipaddress.IPv4Network(lan.subnet)
    return f"""table ip {TABLE} {{
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    oifname "{WAN_DEV}" ip saddr {net} masquerade
  }}
  chain forward {{
    type filter hook forward priority filter; policy drop;
    ct state established,related accept
    iifname "{LAN_DEV}" oifname "{WAN_DEV}" ip saddr {net} accept
    counter drop
  }}
  chain input {{
    type filter hook input priority filter; policy accept;
    iifname "{WAN_DEV}" ct state established,related accept
    iifname "{WAN_DEV}" counter drop
  }}
}}
"""


def dropped_packets(listing: str) -> int:
    """Packets the ruleset's counted drops took, from `nft -j list table ip swarm_lab`."""
    total = 0
    for item in json.loads(listing).get("nftables", []):
        exprs = item.get("rule", {}).get("expr", [])
        if any("drop" in e for e in exprs):
            total += sum(int(e["counter"]["packets"]) for e in exprs if "counter" in e)
    return total
