"""How others reach this peer: its path. The scheduler dials each announced peer back and keeps
what it found retained on `peers/{peer}/reachability` (direct, relayed through a relay, or
unreachable with the remedy); the peer follows its own report, says it in its log once per change
(a WARNING with the flags that fix it when nobody can dial it), and shows it in `swarm_peer_info`.

While its report says unreachable (or from the start with `--behind-nat`), the peer keeps itself
attached to a relay (`swarm.relay.attach.Attachment`: a connection the peer opened, over which the
relay carries calls to its gRPC server). The relays are the peers whose announcement carries a
`relay_address` (`swarm relay`, or a stage server with `--relay`), the one the scheduler's report
found it through listed first, then the latest announced: the attachment re-chooses when its relay
dies, and each change is announced (`PeerAnnouncement.relay`), so callers dial the peer through
it. A relay announced since (a token holder's, say) does not draw the peer away from the relay it
is reached through. The peer attaches with its certificate's key under TLS, else with a key it
made at start (`swarm.relay.identity`), the same for every attachment of this process. The
peer still announces its own address: a dial-back that later finds it answering
makes it direct again, and the attachment is let go. Its /metrics, when it serves one, is carried
too (`local_metrics`): Prometheus scrapes a NAT'd peer through its relay.

A relay lost with no other to take over is either the relay's death or this peer's own outage
(its router unplugged, its Wi-Fi or ISP down): the log tells them apart by dialling `outside`
(the broker's host and port) at that moment. Nothing answering there either is this peer's own
link, not the relay; it attaches again by itself once its link is back, and says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterable, Awaitable, Callable, Sequence
from typing import Protocol

from google.protobuf.message import Message

from stage_server.peer.metrics import StageMetrics
from stage_server.peer.neighbours import Neighbours
from stage_server.peer.outside import answers
from stage_server.peer.path_words import relay_gone, say_report
from swarm.bus.api import BusLike
from swarm.bus.topics import ANY, BusError
from swarm.net import tls
from swarm.net.addresses import host_port, is_unspecified
from swarm.ops.rated import RatedLog
from swarm.policy.backoff import Backoff
from swarm.proto import control_pb2 as cpb
from swarm.relay.attach import Attachment, split_host_port
from swarm.relay.identity import AttachKey
from swarm.relay.limits import raise_nofile, tunnels_within

__all__ = [
    "FIRST_RELAY_S",
    "MAX_RELAYS",
    "REACHABILITY",
    "Attach",
    "Attaching",
    "PeerPath",
    "local_address",
]

log = logging.getLogger(__name__)

MAX_RELAYS = 64
"""Relays remembered from the peers' announcements (the latest announced): every other peer's
announcement arrives here too, and only relays' addresses are kept, so this bounds the memory."""

REACHABILITY = {
    cpb.REACHABILITY_UNKNOWN: "unknown",
    cpb.REACHABILITY_DIRECT: "direct",
    cpb.REACHABILITY_RELAYED: "relayed",
    cpb.REACHABILITY_UNREACHABLE: "unreachable",
}
"""A report's reachability as `swarm_peer_info` labels it."""

_ATTACHED = (cpb.REACHABILITY_UNREACHABLE, cpb.REACHABILITY_RELAYED)  # a relay is wanted

FIRST_RELAY_S = 3.0
"""How long a `--behind-nat` peer at its start holds its first announcement for its attachment
(`PeerPath.first_relay`): the relays' announcements and the attach call take well under it."""


class Attaching(Protocol):
    """What the peer asks of `swarm.relay.attach.Attachment` (a fake stands in for it in tests)."""

    @property
    def relay(self) -> str | None: ...

    seen_from: str  # the address the relay saw it come from ("": not said)

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


Attach = Callable[
    [str, str | None, str, Callable[[], Sequence[str]], Callable[[str | None], None]], Attaching
]
"""Makes an attachment: (peer, token, local_address, relays, on_change), as `Attachment`'s."""


def local_address(listen_host: str, port: int) -> str:
    """Where the attachment dials this peer's own gRPC server: its listening host, or loopback
    when it listens on every interface (an unspecified address is not dialable)."""
    if is_unspecified(listen_host):
        return host_port("::1" if ":" in listen_host else "127.0.0.1", port)
    return host_port(listen_host, port)


class PeerPath:
    """Follows this peer's reachability and keeps it attached to a relay while it needs one.
    `address`: the announced one; `local`: where a relay's calls are delivered (`local_address`);
    `metrics_port`: its /metrics' (None: none), on `local`'s host, where a relayed scrape is
    delivered; `metrics_address`: the announced one;
    `attach`: makes the attachment (`Attachment`; a fake in unit tests)."""

    _key: AttachKey | None

    def _real_attachment(
        self,
        peer: str,
        token: str | None,
        local: str,
        relays: Callable[[], Sequence[str]],
        on_change: Callable[[str | None], None],
    ) -> Attaching:
        """The real attachment: it tells the relay this peer's announced address (the relay shows
        it), and pauses between tries with the swarm's one backoff."""
        pauses = Backoff(0.5, 30.0)
        key = self._key = self._key or AttachKey.of(tls.current())
        # Each call carried takes descriptors here: as many as the process may open, within
        # the soft limit raised to its hard one (as a relay's is).
        tunnels = tunnels_within(raise_nofile())
        return Attachment(
            peer,
            token,
            local,
            relays,
            on_change,
            address=self.address,
            pauses=pauses,
            local_metrics=self.local_metrics,
            metrics_address=self.metrics_address,
            key=key,
            max_tunnels=tunnels,
        )

    def __init__(
        self,
        peer: str,
        address: str,
        *,
        local: str,
        token: str | None,
        behind_nat: bool = False,
        attach: Attach | None = None,
        metrics: StageMetrics | None = None,
        metrics_port: int | None = None,
        metrics_address: str = "",
        outside: str = "",
    ) -> None:
        self.peer, self.address, self.local, self.token = peer, address, local, token
        self.outside = outside  # dialled when the relay is lost: its death, or this peer's link
        self._outage = False  # said that its own link is down: its return is said too
        self._checks: set[asyncio.Task[None]] = set()
        host = split_host_port(local)[0]
        self.local_metrics = "" if metrics_port is None else host_port(host, metrics_port)
        self.metrics_address = metrics_address
        self.behind_nat, self.metrics = behind_nat, metrics
        self._attach = attach or self._real_attachment
        self.report = cpb.ReachabilityReport()  # UNKNOWN until the scheduler's first
        self.relay = ""  # the relay this peer is attached to now, announced as `relay`
        self._relays: OrderedDict[str, str] = OrderedDict()  # relay peer -> its relay_address
        self._neighbours = Neighbours()  # the public address each peer's relay saw
        self._key = None  # what every attachment of this peer signs with, made at the first
        self._attachment: Attaching | None = None
        self._generation = 0  # which attachment's changes count: a stopped one's do not
        self._said: tuple[int, str, str, str] | None = None  # the report last logged
        self._waiting = 0  # the level "no relay announced yet" was said at (once, until one is)
        self._lock = asyncio.Lock()  # one attachment at a time, whoever asks
        self._changed = asyncio.Event()  # the relay changed: announce it
        self._attached = asyncio.Event()  # attached to a relay once (`first_relay`)
        self._failed = RatedLog(log, every_s=60.0)  # each report tries again: said once a minute

    @property
    def public_address(self) -> str:
        """The address this peer's relay saw its attachment come from (its router's public one,
        announced as a failure domain); "" while not attached, or when the relay did not say."""
        attachment = self._attachment
        return attachment.seen_from if attachment is not None and self.relay else ""

    def neighbour(self, peer: str) -> bool:
        """Whether `peer` is behind this peer's router: both relayed, their relays having seen
        them come from one public address (`swarm.rpc.lan`'s scope: only a neighbour's LAN
        address is probed)."""
        return self._neighbours.share(self.public_address, peer)

    def relays(self) -> list[str]:
        """The relays announced now: the one the scheduler's report says this peer answered
        through first, then the latest announced first."""
        relays = list(reversed(self._relays.values()))
        found = self._reported()
        if found in relays:
            relays.remove(found)
            relays.insert(0, found)
        return relays

    def _reported(self) -> str:
        """The relay the scheduler's report says this peer answered through ("": none)."""
        relayed = self.report.reachability == cpb.REACHABILITY_RELAYED
        return self.report.relay if relayed else ""

    @property
    def wanted(self) -> bool:
        """Whether this peer needs a relay: nobody dials it directly, or it says so itself."""
        return self.behind_nat or self.report.reachability in _ATTACHED

    async def first_relay(self) -> None:
        """`--behind-nat` at its start: wait until attached to a relay, at most `FIRST_RELAY_S`, so
        that the peer's first announcement names it (`run` started as a task first: nothing
        else attaches, and without it this waits the whole bound). Announced without
        it, the scheduler's first dial-back found the peer unreachable, and the one through its
        relay, announced a moment later, came only the dial pace after it: relayed about 7 s
        after the start, not 2 (the relays' retained announcements come within milliseconds
        of subscribing, the attachment within one call). Past the bound (no relay, or one slow
        to answer) the peer announces itself without one, as it would have, and attaches when
        it can. A peer the scheduler may still dial directly is not held."""
        if not self.behind_nat:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(FIRST_RELAY_S):
                await self._attached.wait()

    async def run(self, bus: BusLike, announce: Callable[[], Awaitable[None]]) -> None:
        """Follow the report and the relays' announcements, announcing each change of relay
        (`announce`), until cancelled; the attachment is let go on the way out."""
        topics = bus.topics
        reports = bus.subscribe(topics.reachability(self.peer))
        peers = bus.subscribe(topics.peer(ANY))
        if self.behind_nat:
            log.info("%s: behind NAT (--behind-nat): attaching to a relay", self.peer)
        self._show()
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._consume(reports))
                tg.create_task(self._consume(peers))
                tg.create_task(self._announcing(announce))
                await self.steer()  # --behind-nat: at once, when a relay is known already
        finally:
            for check in list(self._checks):
                check.cancel()
            await self._detach("stopping")

    async def _consume(self, messages: AsyncIterable[tuple[str, Message]]) -> None:
        try:
            async for _, message in messages:
                try:
                    if isinstance(message, cpb.ReachabilityReport):
                        await self.on_report(message)
                    elif isinstance(message, cpb.PeerAnnouncement):
                        await self.on_announcement(message)
                except Exception:  # one bad message must not leave the peer unreachable
                    log.exception("%s: could not follow its path", self.peer)
        except BusError as e:  # a broker that refuses the subscription: the peer serves on
            log.warning("%s: cannot follow how others reach it: %s", self.peer, e)

    async def _announcing(self, announce: Callable[[], Awaitable[None]]) -> None:
        while True:
            await self._changed.wait()
            self._changed.clear()
            try:
                await announce()
            except Exception as e:  # a broker hiccup: the next change announces it again
                log.warning("%s: relay %r not announced: %s", self.peer, self.relay, e)

    async def on_report(self, report: cpb.ReachabilityReport) -> None:
        """The scheduler's dial-back found `report`: say it, and attach or let go."""
        self.report = report
        self._say(report)
        self._show()
        await self.steer()

    async def on_announcement(self, announcement: cpb.PeerAnnouncement) -> None:
        """Another peer announced itself: keep its relay address if it relays (and is reached
        directly itself), forget it once it stops; a new relay may be the one to attach to."""
        peer = announcement.peer
        if peer == self.peer:
            return
        self._neighbours.heard(announcement)
        known = self._relays.pop(peer, None)
        usable = announcement.state != cpb.PEER_STATE_OFFLINE and not announcement.relay
        if announcement.relay_address and usable and self._dialable(announcement):
            self._relays[peer] = announcement.relay_address
            kept = {self._reported(), self.relay}  # a flood of relays evicts neither
            for old, address in list(self._relays.items()):
                if len(self._relays) <= MAX_RELAYS:
                    break
                if address not in kept:
                    del self._relays[old]
            if known != announcement.relay_address:
                await self.steer()

    def _dialable(self, announcement: cpb.PeerAnnouncement) -> bool:
        """Whether the relay address `announcement` gives is one (a port out of range ended the
        attachment's connect); one that is not is passed over, said once a minute."""
        try:
            split_host_port(announcement.relay_address)
        except ValueError as e:
            self._failed.warning(
                "relay address", "peer %s announces a relay: %s: passed over", announcement.peer, e
            )
            return False
        return True

    async def steer(self) -> None:
        """Attach when a relay is wanted and none is held; let go when none is wanted."""
        async with self._lock:
            if not self.wanted:
                await self._detach("it is reached directly")
                return
            if self._attachment is not None:
                return
            if not self._relays:
                # --behind-nat at its start: the relays' retained announcements are on their way
                unreachable = self.report.reachability == cpb.REACHABILITY_UNREACHABLE
                level = logging.WARNING if unreachable else logging.INFO
                if self._waiting >= level:
                    return
                self._waiting = level
                log.log(
                    level,
                    "%s: no relay announced yet to attach to: it attaches once one is (a "
                    "reachable stage server started with --relay, or `swarm relay`)",
                    self.peer,
                )
                return
            self._waiting = 0
            self._generation += 1
            generation = self._generation

            def changed(relay: str | None) -> None:
                self._on_change(relay, generation)

            attachment = self._attach(self.peer, self.token, self.local, self.relays, changed)
            try:
                await attachment.start()
            except Exception as e:  # the next relay announced, or report, tries again
                self._failed.warning(
                    type(e).__name__,
                    "%s: could not attach to a relay: %s: %s",
                    self.peer,
                    type(e).__name__,
                    e,
                )
                self._generation += 1
                with contextlib.suppress(Exception):  # whatever it had begun
                    await attachment.stop()
                return
            self._attachment = attachment
            if attachment.relay and not self.relay:  # attached within start: said by no callback
                self._on_change(attachment.relay, generation)

    async def _detach(self, why: str) -> None:
        attachment, self._attachment = self._attachment, None
        if attachment is None:
            return
        self._generation += 1  # what it says while it stops is not news
        try:
            await attachment.stop()
        finally:
            if self.relay:
                log.info("%s: let go of relay %s: %s", self.peer, self.relay, why)
                self.relay = ""
                self._show()
                self._changed.set()

    def _on_change(self, relay: str | None, generation: int) -> None:
        """The attachment `generation` is attached to `relay` now (None: to none)."""
        if generation != self._generation:
            return
        old, self.relay = self.relay, relay or ""
        if self.relay == old:
            return
        if self.relay and not old:
            self._attached.set()
            back = " (its own link is back)" if self._outage else ""
            self._outage = False
            log.info(
                "%s: attached to relay %s%s; announced as reached through it",
                self.peer,
                self.relay,
                back,
            )
        elif self.relay:
            log.warning(
                "%s: relay %s is gone; attached to relay %s instead and announced it",
                self.peer,
                old,
                self.relay,
            )
        elif self.outside:  # the relay's death, or this peer's own outage: a dial tells
            check = asyncio.get_running_loop().create_task(self._lost(old))
            self._checks.add(check)  # held: the loop keeps only a weak reference
            check.add_done_callback(self._checks.discard)
        else:
            relay_gone(self.peer, old)
        self._show()
        self._changed.set()

    async def _lost(self, relay: str) -> None:
        """`relay` was lost and no other answers: say whether this peer's own link is down."""
        if await answers(self.outside):
            relay_gone(self.peer, relay)
            return
        self._outage = True
        log.warning(
            "%s: lost relay %s, and the broker at %s does not answer either: this machine's own "
            "network link is down (its router, Wi-Fi or ISP), not the relay; nobody can call "
            "this peer meanwhile, and it attaches to a relay again by itself once its link is back",
            self.peer,
            relay or "(none)",
            self.outside,
        )

    def _say(self, report: cpb.ReachabilityReport) -> None:
        """Log `report` once per change of what it says (its reachability, address, relay, and
        the remedy of its cause: a relayed dial that fails for another cause is news)."""
        said = (report.reachability, report.address, report.relay, report.remedy)
        if said != self._said:
            self._said = said
            say_report(self.peer, report, self.address, self.relay, self.relays())

    def _show(self) -> None:
        if self.metrics is not None:
            relayed = self.report.reachability == cpb.REACHABILITY_RELAYED
            relay = self.relay or (self.report.relay if relayed else "")
            self.metrics.reached(REACHABILITY.get(self.report.reachability, "unknown"), relay)
