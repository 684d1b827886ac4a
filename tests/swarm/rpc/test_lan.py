"""Peers on one LAN reach each other directly (issue 51, item 7), with real gRPC servers: a
relayed peer whose announced address answers as that peer is dialled there, past its relay; one
where another machine answers (the same private address in another home) or nothing does is
left to its relay, and tried again later; a direct path that fails goes back to the relay. The
relays here are dead ports: a call that reaches the peer at all went past its relay."""

from __future__ import annotations

import asyncio
import logging
import random
import socket
from pathlib import Path

import grpc
import pytest

from swarm.clock import MonotonicClock
from swarm.errors import PeerUnavailable
from swarm.net import paths
from swarm.policy.wiring import Wiring
from swarm.proto import stage_pb2, stage_pb2_grpc
from swarm.rpc.lan import Shortcuts, answers_as_peer
from swarm.rpc.lease import Replica
from swarm.rpc.routes import Routes
from swarm.rpc.stage_client import StageClient
from tests.support.hostile import serving
from tests.support.jobs import make_job

pytestmark = pytest.mark.timeout(60)

PEER = "home-1"


class _Named(stage_pb2_grpc.StageServiceServicer):
    """A replica that answers Info as `peer`."""

    def __init__(self, peer: str) -> None:
        self.peer = peer

    async def Info(  # type: ignore[override]
        self, request: stage_pb2.StageInfoRequest, context: grpc.aio.ServicerContext
    ) -> stage_pb2.StageInfoResponse:
        return stage_pb2.StageInfoResponse(peer=self.peer)


def _free_port() -> int:
    """A port of 127.0.0.1 nothing listens on (bound, then let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _relayed(peer: str, address: str) -> str:
    """`peer` announced at `address`, behind a relay that is not there."""
    return paths.relayed_address(peer, address, f"127.0.0.1:{_free_port()}")


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_a_peer_that_answers_at_its_lan_address_is_dialled_there(tmp_path: Path) -> None:
    job = make_job(tmp_path)
    async with serving(_Named(PEER)) as served:
        address = _relayed(PEER, served)
        shortcuts = Shortcuts()
        assert not shortcuts.direct(address, None)  # not known yet: through the relay meanwhile
        await shortcuts.probed()
        assert shortcuts.direct(address, None)
        past = StageClient(address, job, "job", 0, direct=True)
        through = StageClient(address, job, "job", 0)
        try:
            assert (await past.info()).peer == PEER
            with pytest.raises(PeerUnavailable):  # the relay path is the default, untouched
                await through.info()
        finally:
            await past.close()
            await through.close()


async def test_another_machine_at_the_same_address_is_not_taken_for_the_peer() -> None:
    async with serving(_Named("someone-else")) as served:
        address = _relayed(PEER, served)
        assert not await answers_as_peer(address, None)
        shortcuts = Shortcuts()
        shortcuts.direct(address, None)
        await shortcuts.probed()
        assert not shortcuts.direct(address, None)


async def test_an_address_that_does_not_answer_is_tried_again_later() -> None:
    address = _relayed(PEER, f"127.0.0.1:{_free_port()}")
    probes: list[str] = []

    async def counted(address: str, token: str | None) -> bool:
        probes.append(address)
        return await answers_as_peer(address, token)

    clock = _Clock()
    shortcuts = Shortcuts(counted, retry_s=60.0, clock=clock)
    assert not shortcuts.direct(address, None)
    await shortcuts.probed()
    assert not shortcuts.direct(address, None)
    await shortcuts.probed()
    assert len(probes) == 1  # within the retry time: left to the relay, not probed again
    clock.now = 61.0
    assert not shortcuts.direct(address, None)
    await shortcuts.probed()
    assert len(probes) == 2


async def test_a_probe_that_breaks_is_said_and_the_relay_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A probe that raises (a bug, a dial or TLS set-up gone wrong; a peer that does not answer
    is not this) left the relay path, said at DEBUG: LAN shortcuts off for good, no cause seen
    (a review found it). It is said at WARNING, once a minute per kind."""

    async def broken(address: str, token: str | None) -> bool:
        raise ValueError("no TLS identity for the LAN dial")

    shortcuts = Shortcuts(broken, retry_s=0.0, clock=_Clock())
    address = _relayed(PEER, "10.0.0.7:5000")
    with caplog.at_level(logging.WARNING, logger="swarm.rpc.lan"):
        for _ in range(3):
            assert not shortcuts.direct(address, None)
            await shortcuts.probed()
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1 and "no TLS identity for the LAN dial" in said[0], said
    assert "ValueError" in said[0] and "through its relay" in said[0], said


async def test_a_direct_path_lost_goes_back_to_the_relay_and_is_tried_again() -> None:
    clock = _Clock()
    async with serving(_Named(PEER)) as served:
        address = _relayed(PEER, served)
        shortcuts = Shortcuts(retry_s=60.0, clock=clock)
        shortcuts.direct(address, None)
        await shortcuts.probed()
        assert shortcuts.direct(address, None)
        shortcuts.lost(address)
        assert not shortcuts.direct(address, None)
        await shortcuts.probed()
        assert not shortcuts.direct(address, None)  # not before its retry time
        clock.now = 61.0
        shortcuts.direct(address, None)
        await shortcuts.probed()
        assert shortcuts.direct(address, None)


async def test_disabled_every_call_goes_through_the_relay() -> None:
    async with serving(_Named(PEER)) as served:
        address = _relayed(PEER, served)
        shortcuts = Shortcuts(enabled=False)
        shortcuts.direct(address, None)
        await shortcuts.probed()
        assert not shortcuts.direct(address, None)


async def test_routes_switch_a_peer_to_its_lan_address_and_back(tmp_path: Path) -> None:
    """A sender's client of a relayed replica is replaced by a direct one once the probe says
    so, and by a relayed one again once a call over it failed (`Routes.lost`)."""
    job = make_job(tmp_path)
    wiring = Wiring(job.training.stages, clock=MonotonicClock(), rng=random.Random(0))
    async with serving(_Named(PEER)) as served:
        address = _relayed(PEER, served)
        routes = Routes(job, "job", None, wiring, shortcuts=Shortcuts())
        members = [Replica(PEER, address, 1.0)]
        try:
            routes.follow(1, members)
            first = routes.clients[PEER]
            assert not first.direct
            await routes.shortcuts.probed()
            routes.follow(1, members)
            direct = routes.clients[PEER]
            assert direct is not first and direct.direct
            assert (await direct.info()).peer == PEER
            assert len(routes.retiring) == 1  # the relayed one, closed after its calls' deadline
            routes.lost(PEER, first)  # a call over the retired relayed client: not this path
            assert routes.clients[PEER] is direct and direct.direct
            routes.lost(PEER, direct)
            assert not routes.clients[PEER].direct
            routes.follow(1, members)  # and it stays relayed until its retry time
            assert not routes.clients[PEER].direct
        finally:
            await routes.close()
            await asyncio.sleep(0)


class _Asked(_Named):
    """A replica that answers Info as `peer` and counts who asked."""

    def __init__(self, peer: str) -> None:
        super().__init__(peer)
        self.asked = 0

    async def Info(  # type: ignore[override]
        self, request: stage_pb2.StageInfoRequest, context: grpc.aio.ServicerContext
    ) -> stage_pb2.StageInfoResponse:
        self.asked += 1
        return await super().Info(request, context)


@pytest.mark.attack("64.6-lan")
async def test_only_a_neighbours_lan_address_is_probed() -> None:
    """Issue 64 item 6: every caller (the scheduler's trainer included) probed whatever address
    a relayed peer announced, its loopback for one, with the swarm's token. The process's own
    shortcuts probe nobody until a stage server behind NAT scopes them to its neighbours (peers
    its relay saw come from its own public address)."""
    from swarm.rpc.lan import SHORTCUTS

    listener = _Asked(PEER)
    async with serving(listener) as served:
        address = _relayed(PEER, served)  # "my LAN address is your loopback"
        assert not SHORTCUTS.direct(address, "the-swarm-token")
        await SHORTCUTS.probed()
        assert not SHORTCUTS.direct(address, "the-swarm-token") and listener.asked == 0
        neighbours = {"home-2"}
        scoped = Shortcuts(scope=neighbours.__contains__)
        scoped.direct(address, None)
        await scoped.probed()
        assert listener.asked == 0 and not scoped.direct(address, None)
        neighbours.add(PEER)  # its relay saw it come from this one's router
        scoped.direct(address, None)
        await scoped.probed()
        assert listener.asked == 1 and scoped.direct(address, None)


@pytest.mark.attack("route-clients")
async def test_a_routes_relayed_members_are_probed_only_once_a_call_needs_one(
    tmp_path: Path,
) -> None:
    """A push's route names the members its receiver follows, addresses of the sender's choice:
    each relayed neighbour's announced address was probed (the swarm's token sent there) as the
    route was followed, 1,024 a push. Now only a member a call needs is asked about, and its
    probe starts then."""
    probed: list[str] = []

    async def prober(address: str, token: str | None) -> bool:
        probed.append(address)
        return False

    job = make_job(tmp_path)
    wiring = Wiring(job.training.stages, clock=MonotonicClock(), rng=random.Random(0))
    routes = Routes(job, "job", None, wiring, shortcuts=Shortcuts(prober))
    members = [Replica(f"n{i}", _relayed(f"n{i}", f"10.9.0.{i}:7000"), 1.0) for i in range(50)]
    try:
        routes.follow(1, members)
        await asyncio.sleep(0.05)
        assert probed == [] and len(routes.clients) == 50
        routes.clients["n7"]  # a call needs it
        await routes.shortcuts.probed()
        assert probed == [members[7].address]
        # the members read without a client each: no Mapping's items, values or == (each of
        # which made every member's client), nothing `dict()` reads as a mapping, and `get` of
        # one no member makes none
        assert not hasattr(routes.clients, "values") and not hasattr(routes.clients, "items")
        with pytest.raises(TypeError):
            dict(**routes.clients)  # type: ignore[arg-type]
        assert list(routes.clients.members()) == [m.peer for m in members]
        assert routes.clients.get("n99") is None
        assert list(routes.clients.made()) == ["n7"]
    finally:
        await routes.close()


async def test_a_routes_member_no_client_can_dial_is_unavailable_not_a_bug(tmp_path: Path) -> None:
    """A route's address is checked for its length and characters only; a relayed one that does
    not parse failed the follow before, and now fails its first call as the peer unavailable
    (the hop tries another replica), not as a ValueError out of the hop (a review's repro)."""
    job = make_job(tmp_path)
    wiring = Wiring(job.training.stages, clock=MonotonicClock(), rng=random.Random(0))
    routes = Routes(job, "job", None, wiring)
    try:
        routes.follow(1, [Replica("x", "relay://x", 1.0)])
        with pytest.raises(PeerUnavailable, match="is not relay://"):
            routes.clients["x"]
    finally:
        await routes.close()


async def test_a_member_of_no_speed_is_followed_as_unknown(tmp_path: Path) -> None:
    """A lease's member throughput that is no speed (an infinite one raised out of the wiring
    before; NaN and negative were taken as unknown already): followed, at the wiring's unknown
    figure, beside a member of a real one."""
    job = make_job(tmp_path)
    wiring = Wiring(job.training.stages, clock=MonotonicClock(), rng=random.Random(0))
    routes = Routes(job, "job", None, wiring)
    try:
        members = [Replica("inf", "10.9.0.1:7000", float("inf")), Replica("ok", "10.9.0.2:7000")]
        routes.follow(1, members)
        assert sorted(routes.clients) == ["inf", "ok"]
    finally:
        await routes.close()
