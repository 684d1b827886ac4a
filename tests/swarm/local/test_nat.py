"""A NAT router's description, checked before anything is built (no root needed): a LAN whose
addresses cannot work is refused with the reason, and so are names the lab cannot make devices
of; the ruleset masquerades the LAN alone and forwards nothing that starts outside."""

from __future__ import annotations

import json

import pytest

from swarm.local import nat, netns


def test_a_lan_s_gateway_is_its_first_address() -> None:
    lan = nat.Lan("gw", "10.0.0.2", "192.168.5.0/24", {"a": "192.168.5.10"})
    assert (lan.gateway, lan.prefixlen) == ("192.168.5.1", 24)


@pytest.mark.parametrize(
    ("public", "subnet", "hosts", "says"),
    [
        ("10.0.0.2", "192.168.0.0/16", {}, "use a /24 to a /30"),
        ("192.168.5.7", "192.168.5.0/24", {}, "is in its LAN"),
        ("10.0.0.2", "192.168.5.0/24", {"a": "192.168.6.10"}, "must be in 192.168.5.0/24"),
        ("10.0.0.2", "192.168.5.0/24", {"a": "192.168.5.1"}, "other than the router's"),
    ],
)
def test_a_lan_that_cannot_work_is_refused(
    public: str, subnet: str, hosts: dict[str, str], says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        nat.Lan("gw", public, subnet, hosts)


def test_names_the_lab_cannot_use_are_refused() -> None:
    lan = nat.Lan("pub", "10.0.0.2", "192.168.5.0/24", {"home": "192.168.5.10"})
    with pytest.raises(ValueError, match="unique"):
        netns.Network("swu-", {"pub": "10.0.0.10"}, [lan])  # a router named as a host
    with pytest.raises(ValueError, match="too long"):
        netns.Network("swu-", {"a-very-long-host": "10.0.0.10"})


def test_the_ruleset_masquerades_the_lan_and_drops_what_starts_outside() -> None:
    rules = nat.ruleset(nat.Lan("gw", "10.0.0.2", "192.168.5.0/24"))
    assert 'oifname "eth0" ip saddr 192.168.5.0/24 masquerade' in rules
    assert "type filter hook forward priority filter; policy drop;" in rules
    assert "ct state established,related accept" in rules
    assert 'iifname "eth1" oifname "eth0" ip saddr 192.168.5.0/24 accept' in rules


def test_dropped_packets_counts_the_drops_alone() -> None:
    def rule(*expr: object) -> dict[str, object]:
        return {"rule": {"expr": list(expr)}}

    listing = {
        "nftables": [
            {"metainfo": {}},
            rule({"counter": {"packets": 3, "bytes": 180}}, {"drop": None}),
            rule({"counter": {"packets": 9, "bytes": 540}}, {"accept": None}),
            rule({"match": {}}, {"counter": {"packets": 2, "bytes": 120}}, {"drop": None}),
        ]
    }
    assert nat.dropped_packets(json.dumps(listing)) == 5
