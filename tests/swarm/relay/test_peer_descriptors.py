"""A peer behind NAT carries as many calls through its relay at once as its descriptors allow,
and a call past that bound is said, not dropped unsaid. Each carried call takes some seven
descriptors at the peer; 256 of them (the bound before) at a soft limit of 1,024 left the
peer's own accepts, checkpoints and bus without one (a review's finding)."""

from __future__ import annotations

import logging
import subprocess
import sys

import grpc
import pytest

from swarm.relay.limits import (
    PEER_TUNNEL_DESCRIPTORS,
    RESERVED_DESCRIPTORS,
    RelayLimits,
    tunnels_within,
)
from tests.support.cli import ROOT
from tests.support.relays import echo_bytes, echo_server, relayed
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

TOKEN = "the-swarm-token"

_ATTACHED_AT_1024 = """
import resource
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))  # a usual soft limit, and no higher
from stage_server.peer.reachability import PeerPath
path = PeerPath("p", "203.0.113.7:7000", local="127.0.0.1:7000", token="t")
print(path._attach("p", "t", "127.0.0.1:7000", lambda: [], lambda relay: None).max_tunnels)
"""


def test_the_calls_carried_at_once_fit_the_peers_descriptors() -> None:
    assert tunnels_within(1 << 20) == 256  # a high limit: the bound as before
    assert tunnels_within(1024) == (1024 - RESERVED_DESCRIPTORS) // PEER_TUNNEL_DESCRIPTORS
    assert tunnels_within(300) == 1  # a tiny one: still one call
    done = subprocess.run(
        [sys.executable, "-c", _ATTACHED_AT_1024],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) == tunnels_within(1024), done.stdout  # 256 before


async def test_a_call_past_the_bound_is_said(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="swarm.relay.attach")
    quick = RelayLimits(open_timeout_s=1.0)  # the caller hears "did not answer" after it
    async with echo_server(TOKEN) as port, relayed(TOKEN, port, peer="a", limits=quick) as r:
        await wait_until(lambda: r.attachment.relay is not None)
        r.attachment.max_tunnels = 0  # every call is past it
        with pytest.raises(grpc.aio.AioRpcError):
            await echo_bytes(r.address, TOKEN, [b"x"])
    said = [m.getMessage() for m in caplog.records if "past its" in m.getMessage()]
    assert said and "asked for a call past its 0 carried at once" in said[0], said
