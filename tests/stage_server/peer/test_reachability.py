"""A stage server and how others reach it (issue 42, the peer's side of items 1, 2 and 4).

The peer follows its own reachability report (the scheduler's dial-back, retained on
`peers/{peer}/reachability`): says it in its log once per change, with the remedy's flags when
nobody can dial it, and in `swarm_peer_info`. While unreachable (or from its start with
`--behind-nat`) it keeps attached to a relay, one of the peers that announce a `relay_address`, and
announces `relay=` at each change (re-chosen when its relay dies; none left: empty, and said). A
stage server with `--relay` runs a relay beside its stage and announces it. Every dial of a peer
goes through the one dialer, `swarm.net.dial.channel`.

The attachment itself (`swarm.relay.attach.Attachment`) is faked behind the peer's `Attaching`
protocol; the broker, the gRPC servers and the relay's listener are real.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import logging
import socket
import urllib.request
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from stage_server.agent import PeerAgent
from stage_server.cli import add_arguments, relay_limits
from stage_server.peer import reachability
from stage_server.peer.metrics import StageMetrics
from stage_server.peer.reachability import MAX_RELAYS, PeerPath, local_address
from stage_server.server import RunningStageServer, StageServerOptions, start_grpc
from swarm.bus.broker import EmbeddedBroker
from swarm.bus.connection import Bus, Subscription
from swarm.bus.topics import SCHEDULER_USER, BusError, Topics
from swarm.job.config import RuntimeConfig
from swarm.local.procs import SwarmProcess, start_process
from swarm.net import dial, paths
from swarm.proto import control_pb2 as cpb
from swarm.relay.attach import Attachment
from swarm.relay.server import RelayLimits
from tests.support.cli import ROOT
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

WAIT_S = 20.0
_MAX_BYTES = RuntimeConfig().max_message_bytes
PEER, ADDRESS = "p", "203.0.113.7:7000"
TOKEN = "the-swarm-token"


class FakeAttachment:
    """Stands in for `swarm.relay.attach.Attachment`: attaches to the first of `relays()` that is
    not dead; `die()` kills its relay, and it re-chooses as the real one does."""

    made: list[FakeAttachment] = []

    def __init__(
        self,
        peer: str,
        token: str | None,
        local_address: str,
        relays: Callable[[], Sequence[str]],
        on_change: Callable[[str | None], None],
    ) -> None:
        self.peer, self.token, self.local_address = peer, token, local_address
        self.relays, self.on_change = relays, on_change
        self.dead: set[str] = set()
        self.current: str | None = None
        self.started = self.stopped = False
        self.seen_from = ""
        FakeAttachment.made.append(self)

    @property
    def relay(self) -> str | None:
        return self.current

    def _choose(self) -> None:
        self.current = next((r for r in self.relays() if r not in self.dead), None)
        self.on_change(self.current)

    async def start(self) -> None:
        self.started = True
        self._choose()

    async def stop(self) -> None:
        self.stopped = True
        self.on_change(None)  # what it says while stopping is not news to the peer

    def die(self) -> None:
        assert self.current is not None
        self.dead.add(self.current)
        self._choose()


@pytest.fixture(autouse=True)
def _fresh_attachments() -> None:
    FakeAttachment.made = []


def _path(metrics: StageMetrics | None = None, behind_nat: bool = False) -> PeerPath:
    return PeerPath(
        PEER,
        ADDRESS,
        local="127.0.0.1:7000",
        token="t",
        behind_nat=behind_nat,
        attach=FakeAttachment,
        metrics=metrics,
    )


def _relay(peer: str, address: str, **kw: Any) -> cpb.PeerAnnouncement:
    kw.setdefault("state", cpb.PEER_STATE_JOINING)
    return cpb.PeerAnnouncement(peer=peer, address="198.51.100.1:7000", relay_address=address, **kw)


def _report(reachability: cpb.Reachability, **kw: Any) -> cpb.ReachabilityReport:
    kw.setdefault("address", ADDRESS)
    return cpb.ReachabilityReport(peer=PEER, reachability=reachability, **kw)


UNREACHABLE = _report(
    cpb.REACHABILITY_UNREACHABLE,
    detail="connection timed out",
    remedy="give --announce-host, forward the port, or --relay",
)


def _through(relay: str, report: cpb.ReachabilityReport) -> cpb.ReachabilityReport:
    """`report`, as dialled through `relay` (the scheduler names the relay it tried)."""
    through = cpb.ReachabilityReport()
    through.CopyFrom(report)
    through.relay = relay
    return through


def _said(caplog: pytest.LogCaptureFixture, level: int = logging.INFO) -> list[str]:
    said = (
        r
        for r in caplog.records
        if r.name == "stage_server.peer.reachability" and r.levelno >= level
    )
    return [r.getMessage() for r in said]


# ------------------------------------------------------------------------------- the report


async def test_each_report_is_logged_once_per_change_and_shown_in_peer_info(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="stage_server.peer.reachability")
    metrics = StageMetrics(PEER)
    path = _path(metrics)
    assert metrics.info()["reachability"] == "unknown" and metrics.info()["relay"] == ""
    for _ in range(3):  # the scheduler dials back again and again: said once
        await path.on_report(_report(cpb.REACHABILITY_DIRECT))
    assert _said(caplog) == [f"{PEER}: reachable at {ADDRESS} (direct)"]
    assert metrics.info()["reachability"] == "direct"
    await path.on_report(_report(cpb.REACHABILITY_RELAYED, relay="198.51.100.9:7100"))
    assert _said(caplog)[1] == (
        f"{PEER}: relayed through 198.51.100.9:7100 ({ADDRESS} does not answer directly)"
    )
    assert (metrics.info()["reachability"], metrics.info()["relay"]) == (
        "relayed",
        "198.51.100.9:7100",
    )
    # Relayed, yet not attached here (a report from before a restart): it would attach again.
    assert "no relay announced yet" in _said(caplog)[2] and FakeAttachment.made == []


async def test_an_unreachable_peer_says_why_and_the_flags_that_fix_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="stage_server.peer.reachability")
    metrics = StageMetrics(PEER)
    path = _path(metrics)
    await path.on_report(UNREACHABLE)
    await path.on_report(UNREACHABLE)
    warnings = _said(caplog, logging.WARNING)
    assert warnings[0] == (
        f"{PEER}: not reachable at {ADDRESS}: connection timed out. "
        "give --announce-host, forward the port, or --relay"
    )
    assert "no relay announced yet" in warnings[1] and "--relay" in warnings[1]
    assert len(warnings) == 2, warnings  # each said once
    assert metrics.info()["reachability"] == "unreachable"
    # A report without a remedy: the peer names the flags itself, with its own port.
    await path.on_report(_report(cpb.REACHABILITY_UNREACHABLE, address="203.0.113.7:7001"))
    last = _said(caplog, logging.WARNING)[-1]
    assert last.startswith(f"{PEER}: not reachable at 203.0.113.7:7001: ")
    assert "TCP port 7000" in last and "--announce-host" in last and "--relay" in last


async def test_a_usual_start_behind_nat_is_said_without_a_warning_or_a_to_do_list(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 51: every normal start behind NAT logged a WARNING with the remedy's to-do list
    (forward a port, --announce-host, a relay), while the peer was about to attach to a relay
    by itself. With a relay to take, nothing is wrong: it says so at INFO."""
    caplog.set_level(logging.INFO, logger="stage_server.peer.reachability")
    path = _path()
    await path.on_announcement(_relay("a", "a:1"))
    await path.on_report(UNREACHABLE)
    assert _said(caplog, logging.WARNING) == []
    assert _said(caplog)[-2:] == [
        f"{PEER}: attaching via relay a:1 ({ADDRESS} is not dialled directly: connection "
        "timed out)",
        f"{PEER}: attached to relay a:1; announced as reached through it",
    ]
    # Reached through it; later nobody reaches it even so, dialled through it (the report
    # names the relay it was dialled through): that is worth a warning and remedy.
    await path.on_report(_report(cpb.REACHABILITY_RELAYED, relay="a:1"))
    await path.on_report(_through("a:1", UNREACHABLE))
    assert "not reachable at" in _said(caplog, logging.WARNING)[-1]


async def test_a_report_from_before_the_attachment_is_no_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 68 item 4: a peer behind NAT attached to its relay, then the scheduler's verdict on
    the address it announced before (private, not dialled) arrived and was logged as a WARNING
    whose fix (--announce-host, --dial-private) is wrong for it, 5 s before "relayed through"."""
    caplog.set_level(logging.INFO, logger="stage_server.peer.reachability")
    path = _path(behind_nat=True)
    await path.on_announcement(_relay("a", "a:1"))
    assert path.relay == "a:1"  # attached at its start (--behind-nat)
    early = _report(
        cpb.REACHABILITY_UNREACHABLE,
        address="127.0.0.1:7000",
        detail="a private address, not dialled",
        remedy="give it --announce-host with a public address, or --dial-private",
    )
    await path.on_report(early)
    assert _said(caplog, logging.WARNING) == []
    assert _said(caplog)[-1].startswith(f"{PEER}: attaching via relay a:1 (127.0.0.1:7000 is ")


async def test_a_relayed_dial_back_that_fails_for_another_cause_is_said_at_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Issue 51: unreachable directly, attached, then the dial through the relay fails on the
    # peer's own certificate. Before, the second report was not said (its reachability, address
    # and relay the same), and the log ended on "attached to relay": it looked healthy.
    caplog.set_level(logging.INFO, logger="stage_server.peer.reachability")
    path = _path()
    await path.on_announcement(_relay("a", "a:1"))
    await path.on_report(UNREACHABLE)
    assert path.relay == "a:1"
    mismatch = _report(
        cpb.REACHABILITY_UNREACHABLE,
        relay="a:1",  # dialled through it
        detail="TLS name mismatch: direct: ...; through relay a:1: Hostname Verification failed",
        remedy="its TLS certificate does not name 203.0.113.7: issue it one that does",
    )
    await path.on_report(mismatch)
    last = _said(caplog, logging.WARNING)[-1]
    assert "TLS name mismatch" in last and "does not name 203.0.113.7" in last, last
    await path.on_report(mismatch)  # the same again: said once
    assert sum("TLS name mismatch" in m for m in _said(caplog, logging.WARNING)) == 1


# ------------------------------------------------------------------------- the relays known


async def test_only_live_directly_reached_relays_are_kept_and_they_are_bounded() -> None:
    path = _path()
    await path.on_announcement(
        cpb.PeerAnnouncement(peer="plain", address="h:1", state=cpb.PEER_STATE_JOINING)
    )
    await path.on_announcement(_relay(PEER, "own:1"))  # itself: no
    await path.on_announcement(_relay("nat", "n:1", relay="other:1"))  # itself relayed: no
    await path.on_announcement(_relay("gone", "g:1", state=cpb.PEER_STATE_OFFLINE))
    assert path.relays() == []
    await path.on_announcement(_relay("a", "a:1"))
    await path.on_announcement(_relay("b", "b:1"))
    assert path.relays() == ["b:1", "a:1"], "the latest announced first"
    await path.on_announcement(cpb.PeerAnnouncement(peer="a", state=cpb.PEER_STATE_OFFLINE))
    assert path.relays() == ["b:1"], "a relay's last-will forgets it"
    for i in range(MAX_RELAYS * 4):  # a flood of announced relays: memory stays bounded
        await path.on_announcement(_relay(f"r{i}", f"r{i}:1"))
    relays = path.relays()
    assert len(relays) == MAX_RELAYS and relays[0] == f"r{MAX_RELAYS * 4 - 1}:1"


async def test_an_announced_relay_address_no_relay_can_have_is_passed_over_and_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Kept, it came first in the relays to try (the latest announced), and its connect's
    # OverflowError ended the attachment's task (swarm/relay/attach.py, tested there too).
    caplog.set_level(logging.WARNING, logger="stage_server.peer.reachability")
    path = _path()
    await path.on_announcement(_relay("good", "g:1"))
    for bad in ("evil:99999", "evil:0", "evil"):
        await path.on_announcement(_relay("evil", bad))
    assert path.relays() == ["g:1"]
    said = [r.getMessage() for r in caplog.records if "evil" in r.getMessage()]
    assert len(said) == 1 and "'evil:99999' is not host:port" in said[0], said  # once a minute


# ------------------------------------------------------------------------------ attaching


async def test_an_unreachable_peer_attaches_re_chooses_and_lets_go_when_reached_directly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="stage_server.peer.reachability")
    metrics = StageMetrics(PEER)
    path = _path(metrics)
    await path.on_announcement(_relay("a", "a:1"))
    await path.on_announcement(_relay("b", "b:1"))
    assert FakeAttachment.made == [], "reachable (or not yet known): no relay taken"
    await path.on_report(UNREACHABLE)
    (attachment,) = FakeAttachment.made
    assert attachment.started and attachment.local_address == "127.0.0.1:7000"
    assert (attachment.peer, attachment.token) == (PEER, "t")
    assert path.relay == "b:1" and metrics.info()["relay"] == "b:1"
    await path.on_report(UNREACHABLE)  # said again: the same attachment
    assert len(FakeAttachment.made) == 1
    attachment.die()
    assert path.relay == "a:1"
    assert _said(caplog, logging.WARNING)[-1] == (
        f"{PEER}: relay b:1 is gone; attached to relay a:1 instead and announced it"
    )
    attachment.die()
    assert path.relay == "" and metrics.info()["relay"] == ""
    assert "relay a:1 is gone and no other relay answers" in _said(caplog, logging.WARNING)[-1]
    await path.on_report(_report(cpb.REACHABILITY_DIRECT))
    assert attachment.stopped, "reached directly: the relay is let go"
    assert not path.wanted


async def test_its_own_outage_is_told_from_its_relays_death(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Issue 51: in a home outage every peer logged "relay ... is gone" while its own link was
    # down. When its relay is lost with no other, the peer dials the broker's address: nothing
    # answering there either is its own link.
    caplog.set_level(logging.INFO, logger="stage_server.peer.reachability")
    with socket.socket() as down:  # bound, not listening: the broker's address answers nothing
        down.bind(("127.0.0.1", 0))
        path = PeerPath(
            PEER,
            ADDRESS,
            local="127.0.0.1:7000",
            token="t",
            attach=FakeAttachment,
            outside=f"127.0.0.1:{down.getsockname()[1]}",
        )
        await path.on_announcement(_relay("a", "a:1"))
        await path.on_report(UNREACHABLE)
        FakeAttachment.made[0].die()
        said = await wait_until(
            lambda: [m for m in _said(caplog, logging.WARNING) if "lost relay a:1" in m],
            "the outage said",
        )
    assert "own network link is down" in said[0] and "not the relay" in said[0], said
    assert not any("is gone" in m for m in _said(caplog, logging.WARNING))
    FakeAttachment.made[0].dead.clear()
    FakeAttachment.made[0]._choose()  # its link back: attached again
    assert "attached to relay a:1 (its own link is back)" in _said(caplog)[-1]

    # The broker answers: the relay itself is gone.
    with socket.socket() as up:
        up.bind(("127.0.0.1", 0))
        up.listen()
        path.outside = f"127.0.0.1:{up.getsockname()[1]}"
        FakeAttachment.made[0].die()
        said = await wait_until(
            lambda: [m for m in _said(caplog, logging.WARNING) if "is gone" in m],
            "the relay's death said",
        )
    assert "relay a:1 is gone and no other relay answers" in said[0], said


async def test_behind_nat_attaches_without_waiting_for_a_report(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="stage_server.peer.reachability")
    path = _path(behind_nat=True)
    await path.steer()  # at its start, no relay known yet: it waits for one
    assert FakeAttachment.made == []
    # Not a warning: at its start the relays' retained announcements are still on their way.
    assert "no relay announced yet" in _said(caplog)[0] and not _said(caplog, logging.WARNING)
    await path.on_announcement(_relay("a", "a:1"))
    assert path.relay == "a:1", "the first relay announced is taken"
    await path.on_report(_report(cpb.REACHABILITY_DIRECT))
    assert not FakeAttachment.made[0].stopped, "--behind-nat: the operator said so; kept"


async def test_a_failed_attachment_is_said_and_tried_again_with_the_next_relay(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="stage_server.peer.reachability")
    tries: list[str] = []

    class Refused(FakeAttachment):
        async def start(self) -> None:
            tries.append(self.relays()[0])
            if len(tries) == 1:
                raise ConnectionRefusedError("refused")
            await super().start()

    path = PeerPath(PEER, ADDRESS, local="127.0.0.1:7000", token=None, attach=Refused)
    await path.on_announcement(_relay("a", "a:1"))
    await path.on_report(UNREACHABLE)
    assert path.relay == "" and "could not attach to a relay" in _said(caplog)[-1]
    await path.on_announcement(_relay("b", "b:1"))
    assert tries == ["a:1", "b:1"] and path.relay == "b:1"


async def test_a_broker_refusing_the_report_leaves_the_peer_following_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A broker whose ACL refuses the report's subscription: said, and the peer goes on (its
    agent's task group is not taken down with it)."""
    topics = Topics()

    async def refused() -> AsyncIterator[tuple[str, Message]]:
        raise BusError("the broker refused subscription")
        yield  # pragma: no cover

    async def relays() -> AsyncIterator[tuple[str, Message]]:
        yield topics.peer("a"), _relay("a", "a:1")
        await asyncio.Event().wait()

    bus: Any = SimpleNamespace(
        topics=topics,
        subscribe=lambda pattern: refused() if pattern.endswith("reachability") else relays(),
    )
    path = _path(behind_nat=True)
    announced = asyncio.Event()

    async def announce() -> None:
        announced.set()

    task = asyncio.create_task(path.run(bus, announce))
    await asyncio.wait_for(announced.wait(), WAIT_S)
    assert path.relay == "a:1" and not task.done()
    assert any("cannot follow how others reach it" in m for m in _said(caplog, logging.WARNING))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert FakeAttachment.made[0].stopped


# ------------------------------------------------------------ real broker, real stage servers


@pytest.fixture
async def broker() -> AsyncIterator[EmbeddedBroker]:
    async with EmbeddedBroker() as b:
        yield b


async def _until(
    announcements: Subscription, wanted: Callable[[cpb.PeerAnnouncement], bool]
) -> cpb.PeerAnnouncement:
    async with asyncio.timeout(WAIT_S):
        async for _, message in announcements:
            assert isinstance(message, cpb.PeerAnnouncement)
            if wanted(message):
                return message
    raise AssertionError("the subscription ended")


def _bus(broker: EmbeddedBroker, user: str) -> Bus:
    return Bus(broker.url, f"c-{user}", username=user, registry=CollectorRegistry())


def _peer_info(running: RunningStageServer) -> list[dict[str, str]]:
    url = f"http://127.0.0.1:{running.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return [
        dict(s.labels)
        for family in text_string_to_metric_families(text)
        if family.name == "swarm_peer_info"
        for s in family.samples
    ]


def _accepts(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=5):
            return True
    except OSError:
        return False


async def test_a_peer_the_scheduler_cannot_dial_attaches_to_a_relay_peer_and_announces_it(
    broker: EmbeddedBroker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage server with `--relay` runs a relay and announces it; the NAT'd peer, told by its
    report that nobody dials it, attaches to that relay and announces `relay=`; when the relay
    dies and none is left, it announces none; the relay server's shutdown closes the relay."""
    monkeypatch.setenv("SWARM_CACHE_DIR", str(tmp_path / "cache"))
    topics = Topics()
    relaying = await start_grpc(
        StageServerOptions(stage=-1, peer="r", relay=True), RuntimeConfig().max_message_bytes
    )
    running = await start_grpc(
        StageServerOptions(stage=-1, peer=PEER, metrics_port=0), RuntimeConfig().max_message_bytes
    )
    stop = asyncio.Event()
    try:
        assert relaying.relay_port and relaying.relay_address.endswith(f":{relaying.relay_port}")
        assert _accepts(relaying.relay_address), "the relay listens beside the stage"
        assert running.relay_address == "", "no --relay: no relay"
        async with (
            _bus(broker, SCHEDULER_USER) as sch,
            _bus(broker, "r") as relay_bus,
            _bus(broker, PEER) as bus,
        ):
            for b in (sch, relay_bus, bus):
                await b.wait_connected(WAIT_S)
            peers = sch.subscribe(topics.peer("+"))
            await peers.wait_subscribed(WAIT_S)
            relay_agent = PeerAgent(
                relaying,
                relay_bus,
                peer="r",
                device="cpu",
                relay_address=relaying.relay_address,
            )
            port = int(running.address.rsplit(":", 1)[1])
            path = PeerPath(
                PEER,
                running.address,
                local=local_address("0.0.0.0", port),
                token=None,
                attach=FakeAttachment,
                metrics=running.servicer.metrics,
            )
            agent = PeerAgent(
                running, bus, peer=PEER, device="cpu", metrics=running.servicer.metrics, path=path
            )
            tasks = [asyncio.create_task(a.run(stop)) for a in (relay_agent, agent)]
            announced = await _until(peers, lambda a: a.peer == "r")
            assert announced.relay_address == relaying.relay_address
            await _until(peers, lambda a: a.peer == PEER and a.state == cpb.PEER_STATE_JOINING)
            report = _report(cpb.REACHABILITY_UNREACHABLE, address=running.address)
            await sch.publish(topics.reachability(PEER), report, retain=True)
            attached = await _until(peers, lambda a: a.peer == PEER and a.relay != "")
            assert attached.relay == relaying.relay_address
            assert attached.address == running.address, "it still announces its own address"
            (attachment,) = FakeAttachment.made
            assert attachment.local_address == f"127.0.0.1:{port}", "its own gRPC server"
            assert _peer_info(running) == [
                {
                    "peer": PEER,
                    "state": "idle",
                    "job": "",
                    "stage": "",
                    "reachability": "unreachable",
                    "relay": relaying.relay_address,
                }
            ]
            attachment.die()  # the only relay: none left
            alone = await _until(peers, lambda a: a.peer == PEER and a.relay == "")
            assert alone.state == cpb.PEER_STATE_JOINING
            stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)
            assert attachment.stopped, "a stopping peer lets its relay go"
    finally:
        await running.stop()
        await relaying.stop()
    assert not _accepts(relaying.relay_address), "the ordered shutdown stopped the relay"


@contextlib.asynccontextmanager
async def _starting_peer(
    broker: EmbeddedBroker, *, behind_nat: bool, relayed: bool
) -> AsyncIterator[tuple[Subscription, asyncio.Event, asyncio.Task[None], float]]:
    """A peer's agent started (`behind_nat` or not) with a relay announced already (`relayed`,
    retained) or none: the scheduler's subscription to the announcements, the agent's stop, its
    task and the loop's time it started at."""
    topics = Topics()
    running = await start_grpc(StageServerOptions(stage=-1, peer=PEER), _MAX_BYTES)
    stop = asyncio.Event()
    try:
        async with _bus(broker, SCHEDULER_USER) as sch, _bus(broker, PEER) as bus:
            for b in (sch, bus):
                await b.wait_connected(WAIT_S)
            peers = sch.subscribe(topics.peer("+"))
            await peers.wait_subscribed(WAIT_S)
            if relayed:
                await sch.publish(topics.peer("r"), _relay("r", "r:1"), retain=True)
                await _until(peers, lambda a: a.peer == "r")
            path = PeerPath(
                PEER,
                running.address,
                local=running.address,
                token=None,
                behind_nat=behind_nat,
                attach=FakeAttachment,
            )
            agent = PeerAgent(running, bus, peer=PEER, device="cpu", path=path)
            task = asyncio.create_task(agent.run(stop))
            try:
                yield peers, stop, task, asyncio.get_running_loop().time()
            finally:
                stop.set()
                await asyncio.wait_for(task, WAIT_S)
    finally:
        await running.stop()


async def _heard(peers: Subscription, since: float) -> tuple[cpb.PeerAnnouncement, float]:
    """The peer's next announcement, and how long after `since` it came."""
    announced = await _until(peers, lambda a: a.peer == PEER)
    return announced, asyncio.get_running_loop().time() - since


async def test_behind_nat_its_first_announcement_names_its_relay_and_it_goes_on_at_once(
    broker: EmbeddedBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Announced first without its relay, the scheduler's first dial-back found the peer
    unreachable, and the one through the relay came the dial pace (5 s) after it."""
    monkeypatch.setattr(reachability, "FIRST_RELAY_S", WAIT_S)
    async with _starting_peer(broker, behind_nat=True, relayed=True) as (peers, _, _, started):
        first, _ = await _heard(peers, started)
        assert first.relay == "r:1", "its first announcement is relayed already"
        # The attachment's own announcement, then the agent's, which waited for the
        # attachment, not for the bound.
        second, took = await _heard(peers, started)
        assert second.relay == "r:1" and took < 2.0, took


async def test_behind_nat_with_no_relay_it_still_announces_itself_after_a_bound(
    broker: EmbeddedBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reachability, "FIRST_RELAY_S", 0.5)
    async with _starting_peer(broker, behind_nat=True, relayed=False) as (peers, _, _, started):
        first, took = await _heard(peers, started)
        assert first.relay == "" and first.state == cpb.PEER_STATE_JOINING
        assert 0.5 <= took < WAIT_S, took


async def test_a_peer_not_behind_nat_announces_itself_at_once(
    broker: EmbeddedBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reachability, "FIRST_RELAY_S", WAIT_S)
    async with _starting_peer(broker, behind_nat=False, relayed=True) as (peers, _, _, started):
        first, took = await _heard(peers, started)
        assert first.relay == "" and took < 2.0, took


async def test_a_peer_behind_nat_stopped_while_it_waits_for_a_relay_stops_at_once(
    broker: EmbeddedBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reachability, "FIRST_RELAY_S", WAIT_S)
    async with _starting_peer(broker, behind_nat=True, relayed=False) as (peers, stop, task, _):
        await asyncio.sleep(0.1)
        stop.set()  # a SIGTERM in its first seconds, no relay announced
        await asyncio.wait_for(asyncio.shield(task), 2.0)
        last, _ = await _heard(peers, 0.0)
        while last.state != cpb.PEER_STATE_OFFLINE:
            last, _ = await _heard(peers, 0.0)


async def test_a_taken_relay_port_is_refused_by_its_flag() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        opts = StageServerOptions(stage=-1, peer="r", relay=True, relay_port=port)
        with pytest.raises(Exception, match="--relay-port"):
            await start_grpc(opts, RuntimeConfig().max_message_bytes)


def test_the_flags_of_peers_behind_nat() -> None:
    import argparse

    p = argparse.ArgumentParser()
    add_arguments("stage-server", p)
    given = ["--relay", "--relay-port", "7100", "--relay-max-peers", "3", "--relay-max-calls", "9"]
    args = p.parse_args([*given, "--relay-max-calls-per-peer", "2"])
    assert (args.relay, args.relay_port, args.behind_nat) == (True, 7100, False)
    limits = relay_limits(args)
    assert (limits.max_peers, limits.max_tunnels, limits.max_tunnels_per_peer) == (3, 9, 2)
    assert limits.head_timeout_s == RelayLimits().head_timeout_s, "the rest: the relay's own"
    args = p.parse_args(["--behind-nat"])
    assert args.behind_nat and not args.relay and args.relay_port == 0
    assert relay_limits(args) == RelayLimits(), "the defaults are the relay's"


def test_the_announcement_carries_the_relay_it_runs_and_the_one_it_is_reached_through() -> None:
    running: Any = SimpleNamespace(address=ADDRESS)
    path = _path()
    path.relay = "b:1"
    agent = PeerAgent(
        running,
        SimpleNamespace(),
        peer=PEER,
        device="cpu",
        path=path,
        relay_address="203.0.113.7:7100",
    )
    announcement = agent.announcement()
    assert (announcement.relay, announcement.relay_address) == ("b:1", "203.0.113.7:7100")
    assert announcement.address == ADDRESS


# -------------------------------------------------------------------------- one dialer (item 4)


def test_every_dial_of_a_peer_goes_through_the_one_dialer() -> None:
    """Nothing in the stage server (nor the clients it dials peers with) opens a gRPC channel
    but `swarm.net.dial.channel`, the dialer that knows how each peer is reached."""
    stray = []
    for root in ("stage_server", "swarm/rpc"):
        for file in sorted((ROOT / root).rglob("*.py")):
            for node in ast.walk(ast.parse(file.read_text(), str(file))):
                name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
                if name in ("insecure_channel", "secure_channel"):
                    stray.append(f"{file.relative_to(ROOT)}:{node.lineno}: {name}")  # type: ignore[attr-defined]
    assert stray == [], stray


# ------------------------------------------------------------------------------ real processes

_NONE = cpb.PeerAnnouncement()


async def _health(address: str) -> int:
    """The health of the server at `address`, dialled through the one dialer."""
    channel = dial.channel(address, token=TOKEN)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=WAIT_S)
        return int(reply.status)
    finally:
        await channel.close()


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_real_processes_a_relay_and_a_peer_behind_nat(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    """`swarm stage-server --relay` announces its relay (the address in its ready line, which
    answers); `swarm stage-server --behind-nat`, told by its report that nobody dials it at the
    address it announced, says at the default log level that it attaches via that relay (at
    INFO: the flags of a forwarded port are no fix for it, issue 68 item 4), and (with the real
    attachment) is announced relayed through that relay within 10 s; both stop in order (the
    relay with them)."""
    env = {"SWARM_CACHE_DIR": str(tmp_path / "cache"), "SWARM_TOKEN": TOKEN}  # as deployed
    common = ["stage-server", "--broker", broker.url, "--port", "0"]

    def start(name: str, *flags: str) -> SwarmProcess:
        return start_process(
            [*common, "--peer", name, *flags], log_dir=tmp_path, name=name, env=env
        )

    procs = [start("relay", "--relay"), start("nat", "--behind-nat")]
    topics = Topics()
    latest: dict[str, cpb.PeerAnnouncement] = {}  # each peer's latest announcement

    async def announced(peers: Subscription, want: Callable[[], bool], wait_s: float) -> None:
        async with asyncio.timeout(wait_s):
            while not want():
                _, message = await anext(peers)
                assert isinstance(message, cpb.PeerAnnouncement)
                latest[message.peer] = message

    try:
        relay_ready, nat_ready = [await asyncio.to_thread(p.wait_ready, 120) for p in procs]
        relay_address = f"127.0.0.1:{relay_ready['relay']}"
        assert "relay" not in nat_ready, "no --relay: no relay"
        assert _accepts(relay_address)
        async with _bus(broker, SCHEDULER_USER) as sch:
            await sch.wait_connected(WAIT_S)
            peers = sch.subscribe(topics.peer("+"))
            await peers.wait_subscribed(WAIT_S)
            await announced(peers, lambda: latest.get("relay", _NONE).relay_address != "", WAIT_S)
            assert latest["relay"].relay_address == relay_address
            report = cpb.ReachabilityReport(
                reachability=cpb.REACHABILITY_UNREACHABLE,
                address=nat_ready["address"],
                detail="connection refused",
            )
            await sch.publish(topics.reachability("nat"), report, retain=True)
            said = (
                f"nat: attaching via relay {relay_address} ({nat_ready['address']} is not "
                "dialled directly: connection refused)"
            )
            async with asyncio.timeout(WAIT_S):
                while said not in procs[1].log():
                    await asyncio.sleep(0.1)
            line = next(x for x in procs[1].log().splitlines() if said in x)
            assert " INFO " in line and "not reachable at" not in procs[1].log(), line
            # Attached: the relay carries its calls.
            await announced(peers, lambda: latest.get("nat", _NONE).relay != "", 10)
            assert latest["nat"].relay == relay_address
            assert latest["nat"].address == nat_ready["address"]
            relayed = paths.relayed_address("nat", nat_ready["address"], relay_address)
            assert await _health(relayed) == health_pb2.HealthCheckResponse.SERVING
    finally:
        codes = [await asyncio.to_thread(p.stop) for p in procs]
    assert codes == [0, 0], [p.log()[-2000:] for p in procs]
    assert not _accepts(relay_address), "the relay stopped with its server"


def test_the_attachment_carries_the_peers_metrics_too() -> None:
    """A NAT'd stage server's /metrics is scraped through its relay: its attachment is told
    where it listens (on the gRPC server's local host) and where it is announced."""
    path = PeerPath(
        PEER,
        "203.0.113.9:7000",
        local="127.0.0.1:7000",
        token="t",
        metrics_port=9101,
        metrics_address="203.0.113.9:9101",
    )
    attachment = path._real_attachment(PEER, "t", path.local, path.relays, lambda _: None)
    assert isinstance(attachment, Attachment)
    assert (attachment.local_metrics, attachment.metrics_address) == (
        "127.0.0.1:9101",
        "203.0.113.9:9101",
    )
    bare = PeerPath(PEER, "203.0.113.9:7000", local="127.0.0.1:7000", token="t")
    attachment = bare._real_attachment(PEER, "t", bare.local, bare.relays, lambda _: None)
    assert isinstance(attachment, Attachment) and attachment.metrics_address == ""
