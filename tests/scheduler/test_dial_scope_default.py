"""Where the dial-back may dial by default (`--dial-scope auto`): a scheduler that announces a
loopback or private address heads a swarm of one machine or one LAN, whose peers announce such
addresses too, so README's one-machine recipe works without a flag; one that announces a public
address or a name keeps its dial-back to public addresses (issue 54, M-scan)."""

from __future__ import annotations

import pytest

from scheduler.dial_scope import private_swarm
from swarm.cli import parse


@pytest.mark.parametrize(
    ("announced", "private"),
    [
        ("127.0.0.1", True),
        ("localhost", True),
        ("192.168.1.10", True),
        ("10.0.0.5", True),
        ("[::1]", True),
        ("8.8.8.8", False),
        ("sched.example.org", False),  # a name: the swarm's public face
        ("0.0.0.0", False),  # no address at all says nothing private
    ],
)
def test_a_scheduler_announced_at_a_private_address_heads_a_private_swarm(
    announced: str, private: bool
) -> None:
    assert private_swarm(announced) is private


@pytest.mark.parametrize(
    ("flags", "private"),
    [
        (["--host", "127.0.0.1"], True),  # README's one machine
        (["--host", "0.0.0.0", "--announce-host", "sched.example.org"], False),
        (["--host", "127.0.0.1", "--dial-scope", "public"], False),
        (["--host", "0.0.0.0", "--announce-host", "8.8.8.8", "--dial-scope", "any"], True),
        (["--host", "0.0.0.0", "--announce-host", "8.8.8.8", "--dial-private"], True),
    ],
)
def test_the_scope_the_flags_choose(
    flags: list[str], private: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from scheduler.cli import _dial_private

    monkeypatch.delenv("SWARM_DIAL_PRIVATE", raising=False)  # the tests' default for processes
    monkeypatch.delenv("SWARM_DIAL_SCOPE", raising=False)
    args = parse(["scheduler", "--data-root", ".", *flags])
    assert _dial_private(args) is private
