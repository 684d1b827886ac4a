"""Bind one address, announce another: real stage servers and a real scheduler listening on every
interface announce the address given (`--announce-host`), refuse to announce one nobody can dial,
and work over IPv6."""

from __future__ import annotations

import pytest

from swarm.errors import ConfigError
from swarm.net.addresses import announced_host, host_port, is_unspecified


def test_addresses_are_written_and_judged_as_dialable_or_not() -> None:
    assert host_port("10.0.0.7", 7700) == "10.0.0.7:7700"
    assert host_port("::1", 7700) == host_port("[::1]", 7700) == "[::1]:7700"
    assert [is_unspecified(h) for h in ("0.0.0.0", "::", "[::]", "", "127.0.0.1", "node-3")] == [
        True,
        True,
        True,
        True,
        False,
        False,
    ]
    assert announced_host("0.0.0.0", "203.0.113.9") == "203.0.113.9"
    assert announced_host("::1") == "::1"
    with pytest.raises(ConfigError, match=r"--host 0\.0\.0\.0: a stage server would announce"):
        announced_host("0.0.0.0", "", "a stage server")
    with pytest.raises(ConfigError, match="--announce-host ::"):
        announced_host("0.0.0.0", "::")
