"""A peer behind NAT left on the default host serves on its own LAN address (issue 68 item 2),
and only then: `tests/system/test_friends_home.py` runs it behind a real router. Here, what keeps
the host as given: an explicit --host or --announce-host, a peer not behind NAT, no token (a LAN
port without one would take anyone's calls), no private route (loopback names no LAN)."""

from __future__ import annotations

from stage_server.peer.lan_host import DEFAULT_HOST, serving_host
from swarm.net.addresses import lan_address

BROKER = "mqtts://127.0.0.1:8883"


def test_the_host_given_is_kept_unless_behind_nat_on_the_default() -> None:
    kept = [
        ("0.0.0.0", "", True, "t"),  # --host given
        (DEFAULT_HOST, "203.0.113.7", True, "t"),  # --announce-host given
        (DEFAULT_HOST, "", False, "t"),  # reachable: not behind NAT
        (DEFAULT_HOST, "", True, None),  # no token: no open port on the LAN
    ]
    for host, announce, behind_nat, token in kept:
        chosen = serving_host(host, announce, behind_nat=behind_nat, broker=BROKER, token=token)
        assert chosen == host, (host, announce, behind_nat, token)
    # a broker on loopback: no LAN routes there, so loopback it stays
    assert serving_host(DEFAULT_HOST, "", behind_nat=True, broker=BROKER, token="t") == DEFAULT_HOST


def test_a_lan_address_is_private_or_nothing() -> None:
    assert lan_address("127.0.0.1") == "" and lan_address("") == ""
    assert lan_address("no-such-host.invalid") == ""
