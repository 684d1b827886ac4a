"""Which host a peer's seat is on (`swarm.net.seats`): one public host is one seat however its
address is written. A seat was the host's text as announced: `EVIL.example` and `evil.example`,
or `2606:4700::1` and `2606:4700:0::1`, were two hosts, and two ids of one machine held two
seats of a stage and convicted an honest third replica with their matching re-executions."""

from __future__ import annotations

import pytest

from swarm.net.seats import seat


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ("evil.example:7000", "EVIL.example:7001"),
        ("evil.example:7000", "evil.example.:7001"),  # the root's dot
        ("[2606:4700::1]:7000", "[2606:4700:0::1]:7001"),
        ("[2606:4700::1]:7000", "[2606:4700::0001]:7001"),
        ("[2606:4700::1]:7000", "[2606:4700:0:0:0:0:0:1]:7001"),
        ("8.8.8.8:7000", "[::ffff:8.8.8.8]:7001"),  # an IPv4 host as IPv6 maps it
    ],
)
def test_one_public_host_is_one_seat_however_it_is_written(one: str, other: str) -> None:
    assert seat(one, "a") == seat(other, "b")


def test_hosts_and_private_addresses_stay_apart() -> None:
    assert seat("evil.example:7000", "a") != seat("good.example:7000", "b")
    assert seat("8.8.8.8:7000", "a") != seat("8.8.4.4:7000", "b")
    # private and loopback addresses by port: one operator's LAN box, a test's swarm
    assert seat("10.0.0.1:7000", "a") != seat("10.0.0.1:7001", "b")
    assert seat("127.0.0.1:7000", "a") != seat("127.0.0.1:7001", "b")
    assert seat("", "a") == "peer a" != seat("", "b")
