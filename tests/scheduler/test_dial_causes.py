"""A failed dial-back named by its real cause (issue 51, item 2): real gRPC servers over real TLS,
a real relay, the scheduler's own `StageDialer`; each cause its own words and remedy. Before,
any detail with UNAUTHENTICATED in it got the token's remedy, a TLS name mismatch included."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from scheduler.dial_back import StageDialer
from scheduler.dial_causes import Cause, cause_of, verdict
from scheduler.dial_scope import DialScope
from scheduler.reachability import ReachabilityChecker
from swarm.net import paths, tls, tokens
from swarm.net.certs import init_ca, issue
from swarm.ops.rated import RatedLog
from swarm.proto import control_pb2 as cpb
from swarm.proto import stage_pb2 as pb
from swarm.proto import stage_pb2_grpc
from tests.support.ports import free_address
from tests.support.relays import NAT_HOST, relayed
from tests.support.tls import no_identity

__all__ = ["no_identity"]  # autouse: no TLS identity left to the next test

pytestmark = pytest.mark.timeout(60)

TOKEN = "the-swarm-token"


class _Info(stage_pb2_grpc.StageServiceServicer):
    """A peer's StageService.Info, what the dial-back calls, answering as `peer`."""

    def __init__(self, peer: str) -> None:
        self.peer = peer

    async def Info(self, request: pb.StageInfoRequest, context: Any) -> pb.StageInfoResponse:
        return pb.StageInfoResponse(peer=self.peer)


@contextlib.asynccontextmanager
async def stage_service(peer: str) -> AsyncIterator[int]:
    """A real gRPC server on 127.0.0.1 behind the swarm token, over TLS with the process's
    identity, whose StageService answers Info as `peer`; its port."""
    refusals = RatedLog(logging.getLogger("tests.dial_causes"))
    server = grpc.aio.server(
        interceptors=tokens.server_interceptors(TOKEN, CollectorRegistry(), refusals)
    )
    stage_pb2_grpc.add_StageServiceServicer_to_server(_Info(peer), server)
    port = tokens.add_port(server, "127.0.0.1:0", "the peer")
    await server.start()
    try:
        yield port
    finally:
        await server.stop(grace=None)


def _checker(token: str | None = TOKEN) -> ReachabilityChecker:
    async def publish(peer: str, report: cpb.ReachabilityReport | None) -> None:
        pass

    return ReachabilityChecker(
        StageDialer(token),
        publish,
        lambda report: None,
        timeout_s=2.0,
        scope=DialScope(allow_private=True),  # its servers are on loopback
        # Causes and remedies are what is under test here: a failure said at once, not padded
        # to `timeout_s` (the pacing has its own test, tests/scheduler/test_reachability.py).
        pace_failures=False,
    )


def _become(tmp_path: Path, *hosts: str, peers: tuple[str, ...] = ()) -> None:
    """This process serves and dials TLS with a certificate of a fresh CA naming `hosts` and the
    peer ids `peers` (what a relayed peer is verified by)."""
    init_ca(tmp_path)
    issue(tmp_path, "peer", list(hosts), peers=list(peers))
    tls.configure(tls.Tls.load(tmp_path / "ca.pem", tmp_path / "peer.pem", tmp_path / "peer.key"))


async def test_a_certificate_that_does_not_name_the_address_is_no_token_problem(
    tmp_path: Path,
) -> None:
    # The guide's home peer: its certificate names its LAN address, it announces another.
    _become(tmp_path, "192.168.1.10")
    async with stage_service("a") as port:
        report = await _checker().measure("a", f"127.0.0.1:{port}", "")
        assert report.reachability == cpb.REACHABILITY_UNREACHABLE
        assert report.detail.startswith("TLS name mismatch"), report.detail
        assert "token" not in report.remedy, report.remedy
        assert "does not name 127.0.0.1" in report.remedy
        assert "swarm certs issue NAME --host 127.0.0.1" in report.remedy

        # The same through its relay: the peer's certificate, not the relay, is at fault, and
        # through a relay what it must name is its peer id (`swarm.net.paths.peer_name`).
        async with relayed(TOKEN, port) as r:
            through = await _checker().measure(r.peer, r.announced, r.relay_address)
        assert through.reachability == cpb.REACHABILITY_UNREACHABLE
        assert through.detail.startswith("TLS name mismatch"), through.detail
        assert f"does not name its peer id ({r.peer}.peer.swarm)" in through.remedy
        assert f"--peer {r.peer}" in through.remedy and "token" not in through.remedy


async def test_each_cause_has_its_own_remedy(tmp_path: Path) -> None:
    _become(tmp_path, "127.0.0.1", NAT_HOST, peers=("home-gpu",))
    remedies: dict[Cause, str] = {}
    async with stage_service("home-gpu") as port:
        # A peer with another token: it refuses the scheduler's.
        wrong = await _checker("another-token").measure("a", f"127.0.0.1:{port}", "")
        assert wrong.detail.startswith("wrong token"), wrong.detail
        remedies[Cause.TOKEN] = wrong.remedy
        assert "--token-file" in wrong.remedy

        async with relayed(TOKEN, port) as r:
            ok = await _checker().measure(r.peer, r.announced, r.relay_address)
            assert ok.reachability == cpb.REACHABILITY_RELAYED, ok.detail
            # The relay answers, but no peer of that id is attached to it.
            other = await _checker().measure("stranger", r.announced, r.relay_address)
            assert other.detail.startswith("not attached to its relay"), other.detail
            assert f"not attached to relay {r.relay_address}" in other.remedy
            remedies[Cause.NOT_ATTACHED] = other.remedy

    # Its relay gone: the relay is named, with what brings one back.
    gone = free_address()
    down = await _checker().measure("a", f"{NAT_HOST}:7000", gone)
    assert down.detail.startswith("relay down"), down.detail
    assert f"relay {gone} does not answer" in down.remedy
    assert "restart the relay" in down.remedy and "second relay" in down.remedy
    remedies[Cause.RELAY_DOWN] = down.remedy

    # Nothing at its address, no relay: the flags that make it reachable.
    nobody = free_address()
    silent = await _checker().measure("a", nobody, "")
    assert silent.detail.startswith("no answer"), silent.detail
    assert "--announce-host" in silent.remedy and "swarm relay" in silent.remedy
    remedies[Cause.NO_ANSWER] = silent.remedy
    assert len(set(remedies.values())) == len(remedies), remedies


def test_the_relays_answers_and_a_token_refusal_are_told_apart() -> None:
    # The texts gRPC gives (measured above with real servers); the relay's refusals by code.
    name = "UNAVAILABLE: ipv4:127.0.0.1:1: Custom verification check failed with error: "
    assert cause_of(name + "UNAUTHENTICATED: Hostname Verification Check failed.", True) == (
        Cause.TLS_NAME
    )
    refused = "UNAUTHENTICATED: wrong token; this swarm needs its token"
    assert cause_of(refused, False) is Cause.TOKEN
    proxy = "UNAVAILABLE: ipv4:127.0.0.1:1: HTTP proxy returned response code "
    assert cause_of(proxy + "407", True) is Cause.RELAY_REFUSES
    assert cause_of(proxy + "502", True) is Cause.NOT_ATTACHED
    assert cause_of(proxy + "504", True) is Cause.PEER_SILENT
    connect = "UNAVAILABLE: Failed to connect to remote host: Connection refused"
    assert cause_of(connect, True) is Cause.RELAY_DOWN
    assert cause_of(connect, False) is Cause.NO_ANSWER
    assert paths.relayed_address("a", "h:1", "r:2").startswith(paths.SCHEME)


def test_a_relayed_name_mismatch_names_the_peer_id_to_issue_not_the_announced_host() -> None:
    # Through a relay a peer is verified by its peer id (`peer_name`): the fix is `--peer`.
    name = "UNAVAILABLE: ipv4:127.0.0.1:1: Custom verification check failed with error: "
    mismatch = name + "UNAUTHENTICATED: Hostname Verification Check failed."
    silent = "UNAVAILABLE: Failed to connect to remote host: Connection timed out"
    cause, detail, fix = verdict("192.168.1.10:7000", silent, "r:2", mismatch, "home-gpu-1")
    assert cause is Cause.TLS_NAME and detail.startswith("TLS name mismatch: direct: ")
    assert "home-gpu-1.peer.swarm" in fix and "swarm certs issue NAME --peer home-gpu-1" in fix
    assert "--host" not in fix
    # directly dialled, it is still the announced host the certificate must name
    _, _, direct_fix = verdict("203.0.113.7:7000", mismatch, peer="p")
    assert "--host 203.0.113.7" in direct_fix
