"""The relayed address form: written and read back by the one module that knows it."""

from __future__ import annotations

import pytest

from swarm.net.paths import Path, parse, relayed_address


def test_a_relayed_address_reads_back_its_peer_relay_and_target() -> None:
    address = relayed_address("home-gpu-1", "192.168.1.20:7001", "203.0.113.5:7100")
    assert address == "relay://home-gpu-1@203.0.113.5:7100/192.168.1.20:7001"
    assert parse(address) == Path("192.168.1.20:7001", "203.0.113.5:7100", "home-gpu-1")
    six = relayed_address("p", "[fd00::2]:7001", "[2001:db8::1]:7100")
    assert parse(six) == Path("[fd00::2]:7001", "[2001:db8::1]:7100", "p")


def test_a_plain_address_has_no_relay() -> None:
    assert parse("10.0.0.7:7700") == Path("10.0.0.7:7700", None, None)
    assert parse("[::1]:7700").relay is None


@pytest.mark.parametrize(
    "bad", ["relay://", "relay://p@r:1", "relay://r:1/t:2", "relay://@r:1/t:2", "relay://p@/t:2"]
)
def test_a_relayed_address_missing_a_part_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="is not relay://PEER@RELAY_HOST:PORT/PEER_HOST:PORT"):
        parse(bad)


def test_parts_that_would_read_back_otherwise_are_refused() -> None:
    for peer, address, relay in (("a@b", "t:1", "r:1"), ("", "t:1", "r:1"), ("p", "t:1", "r/1")):
        with pytest.raises(ValueError):
            relayed_address(peer, address, relay)
