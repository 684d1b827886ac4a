"""A relay: carries calls to peers behind NAT over connections those peers opened themselves.

One TCP port takes three kinds of connection (`swarm.relay.wire` has their bytes):
a NAT'd peer's long-lived control connection (ATTACH), a caller's tunnel (an HTTP CONNECT, what
gRPC's `grpc.http_proxy` channel option sends), and the data connection the peer opens back for
each tunnel when the relay asks it to over its control connection (DATA). The relay splices the
caller's and the peer's connections byte for byte: TLS and HTTP/2 stay end to end, so with TLS on
the caller verifies the NAT'd peer's own certificate and the relay reads nothing it carries.

A tunnel goes to the peer's announced gRPC or metrics address (Prometheus's scrape; for an
http:// target a plain proxy request), no other: the peer is told which of its two servers to
dial, never an address, so a relay is no way into the peer's network.

Who gets in (`swarm.relay.auth`): every request proves the swarm token, each in its own
derived form, so a stranger can neither attach nor open a tunnel, and an overheard attach cannot
be replayed. Who attaches (`swarm.relay.identity`): an attachment is bound to the key that signed
its challenge (with the swarm's CA, a certificate naming the peer id); an attach under the same
id with another key is refused while the attachment answers a ping, so no token holder takes a
live peer's calls. What one connection or source can hold (`swarm.relay.limits`): a request head
is read within a time and a size, from a pool of its own for the data connections the relay
asked for; heads, peers and tunnels are counted in all, per peer and per source, sized to the
process's descriptors; a tunnel reads at most a bounded amount ahead of the side it writes to.
Refusals are counted by reason and logged rated.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections import Counter as Tally
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge

from swarm.deadline import within
from swarm.net.addresses import host_port
from swarm.net.paths import relay_credential
from swarm.ops.rated import RatedLog
from swarm.relay.attach import METRICS
from swarm.relay.auth import (
    data_proof,
    metrics_credential,
    proxy_user,
    same,
)
from swarm.relay.control import Attached, Peers
from swarm.relay.copier import splice
from swarm.relay.limits import RelayLimits, nofile, release, source_of
from swarm.relay.wire import (
    PROTOCOL,
    Head,
    HeadError,
    address_key,
    answer,
    close,
    linger,
    origin_form,
    read_head,
)

__all__ = ["RelayLimits", "RelayServer"]

log = logging.getLogger(__name__)

Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class _Refused(Exception):
    """A tunnel refused: its answer's `status` and `reason`, counted under `key`."""

    def __init__(self, status: int, key: str, reason: str) -> None:
        super().__init__(reason)
        self.status, self.key, self.reason = status, key, reason


class RelayServer:
    """`await start(host, port)` -> the bound port; `await stop()`. `token` None: open (a
    trusted network); `ca`: the swarm CA (PEM), whose certificates naming a peer id alone
    attach as it (None: a peer's own key, `swarm.relay.identity`); `registry`: where its
    metrics go; `refusals`: its refusal log, rated (strangers cause refusals at will; keyed by
    the refusal's reason), or None: at DEBUG. `addresses`: what peers dial it by, as signed in
    their attaches; `start` adds its listening address, whoever announces it adds that."""

    def __init__(
        self,
        token: str | None,
        limits: RelayLimits | None = None,
        *,
        registry: CollectorRegistry | None = None,
        refusals: RatedLog | None = None,
        ca: bytes | None = None,
    ) -> None:
        self.token, self.ca = token or None, ca
        self.limits = limits or RelayLimits()
        self.addresses: set[str] = set()
        self._log = refusals
        registry = registry if registry is not None else CollectorRegistry()
        self.refused = Counter(
            "swarm_relay_refused_total",
            "Connections this relay refused, by reason",
            ["reason"],
            registry=registry,
        )
        self.attaches = Counter(
            "swarm_relay_attaches_total", "Attachments this relay took", registry=registry
        )
        self.opened = Counter(
            "swarm_relay_tunnels_total", "Tunnels this relay opened", registry=registry
        )
        self.carried = Counter(
            "swarm_relay_bytes_total", "Bytes carried through tunnels, both ways", registry=registry
        )
        self.peers_gauge = Gauge(
            "swarm_relay_attached_peers", "Peers attached now", registry=registry
        )
        self.tunnels_gauge = Gauge(
            "swarm_relay_open_tunnels", "Tunnels open now", registry=registry
        )
        self._peers = Peers(
            self.token,
            ca,
            lambda: self.limits,
            self.addresses,
            self._refuse,
            self._head,
            self.peers_gauge,
            self.attaches,
        )
        self._calls: dict[str, tuple[str, asyncio.Future[Stream]]] = {}
        self._tunnels = 0
        self._heads = 0
        # Per source (`source_of`): heads pending, peers attached, tunnels opened as caller;
        # calls waiting for a data connection from a source, and those heads being read.
        self._source_heads: Tally[str] = Tally()
        self._source_tunnels: Tally[str] = Tally()
        self._expected: Tally[str] = Tally()
        self._data_heads: Tally[str] = Tally()
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    @property
    def peers(self) -> dict[str, str]:
        """The attached peers and the addresses they announced."""
        return {p: a.address for p, a in self._peers.held.items()}

    @property
    def tunnels(self) -> int:
        """Tunnels open now, in all."""
        return self._tunnels

    def tunnels_of(self, peer: str) -> int:
        """Tunnels open now to `peer` (0 when it is not attached)."""
        attached = self._peers.held.get(peer)
        return attached.tunnels if attached is not None else 0

    async def start(self, host: str, port: int) -> int:
        # Sized to the descriptors this process may open (`raise_nofile` raised them first).
        self.limits = self.limits.sized(nofile())
        self._server = await asyncio.start_server(self._connected, host, port)
        bound = int(self._server.sockets[0].getsockname()[1])
        self.addresses.add(host_port(host, bound))
        log.info("relay listening on %s:%d", host, bound)
        return bound

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for attached in list(self._peers.held.values()):
            attached.writer.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    # -- one connection ------------------------------------------------------------------------
    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # type: ignore[arg-type]
        kept = False  # a DATA connection is handed to its tunnel, which closes it
        try:
            try:
                kept = await self._serve(reader, writer)
            finally:
                if not kept:
                    await close(writer)
        except (ConnectionError, OSError, TimeoutError, ValueError):
            pass  # the other side went away, or sent a line past the stream's limit
        except asyncio.CancelledError:
            pass  # stop(): asyncio's server would log a cancelled handler as an error
        finally:
            self._tasks.discard(task)  # type: ignore[arg-type]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        where = writer.get_extra_info("peername")
        source = source_of(where)
        # A data connection this relay asked for has its own pool and time; any other head, a
        # stranger's as much as a caller's, is bounded in all and per source, and timed short.
        expected = self._expected[source] > self._data_heads[source]
        timeout_s = self.limits.data_timeout_s if expected else self.limits.head_timeout_s
        pending = self._source_heads[source]
        if not expected and (
            self._heads >= self.limits.max_heads or pending >= self.limits.max_heads_per_source
        ):
            self._refuse(
                "busy",
                "refused a connection from %s: %d request heads pending (%d from its source)",
                where,
                self._heads,
                pending,
            )
            return False
        try:
            with self._head(source, expected):
                head = await within(read_head(reader, self.limits.max_head_bytes), timeout_s)
        except HeadError as e:
            self._refuse("head", "refused a request from %s: %s", where, e.reason)
            await answer(writer, e.status, e.reason)
            await linger(reader)
            return False
        except TimeoutError:
            self._refuse("slow", "dropped %s: no request head in %.0f s", where, timeout_s)
            return False
        if head.method == "CONNECT" or origin_form(head) is not None:
            await self._tunnel(head, reader, writer, where)
        elif head.method == "ATTACH" and head.version == PROTOCOL:
            await self._peers.serve(head, reader, writer, where)
        elif head.method == "DATA" and head.version == PROTOCOL:
            return self._data(head, reader, writer, where)
        else:
            self._refuse("head", "refused %s: method %.16r", where, head.method)
            await answer(writer, 405, "this relay takes CONNECT (or a proxy request for /metrics)")
        return False

    @contextlib.contextmanager
    def _head(self, source: str, expected: bool) -> Iterator[None]:
        """Holds a head's slot: in the pool of expected data connections, or in all and in its
        source's."""
        tally, counted = (self._data_heads, 0) if expected else (self._source_heads, 1)
        tally[source] += 1
        self._heads += counted
        try:
            yield
        finally:
            self._heads -= counted
            release(tally, source)

    def _refuse(self, reason: str, msg: str, *args: object) -> None:
        self.refused.labels(reason).inc()
        if self._log is None:
            log.debug("relay " + msg, *args)  # a flood fills no log either
        else:
            self._log.warning(reason, "relay " + msg, *args)

    # -- a caller's tunnel -----------------------------------------------------------------------
    async def _tunnel(
        self, head: Head, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, where: object
    ) -> None:
        target, forward = head.target, b""
        form = origin_form(head)
        if head.method != "CONNECT" and form is not None:  # a plain HTTP proxy request
            target, forward = form
        named = self._credential(head)
        if named is None:
            self._refuse("credential", "refused a tunnel from %s: no or wrong credential", where)
            await answer(writer, 407, "this relay needs the swarm's credential for the peer")
            return
        try:
            attached, kind = self._route(named, target)
            if forward and kind != METRICS:
                raise _Refused(403, "target", "only a peer's metrics take a plain HTTP request")
        except _Refused as e:
            self._refuse(e.key, "refused a tunnel from %s to %.64r: %s", where, target, e.reason)
            await answer(writer, e.status, e.reason)
            return
        peer, scrape, source = attached.peer, kind == METRICS, source_of(where)
        full = self._full(attached, scrape, source, where)
        if full is not None:
            await answer(writer, 503, full)
            return
        self._take(attached, scrape, source)
        try:
            data = await self._open(attached, kind)
            if data is None:
                self._refuse("no-data", "peer %s opened no connection for a tunnel", peer)
                await answer(writer, 504, f"peer {peer} did not answer through this relay")
                return
            self.opened.inc()
            if forward:  # the request goes on to the peer's /metrics, which answers it
                data[1].write(forward)
            else:
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await splice((reader, writer), data, self.limits.chunk_bytes, self.carried.inc)
        finally:
            self._give_back(attached, scrape, source)

    def _full(self, attached: Attached, scrape: bool, source: str, where: object) -> str | None:
        """Why a tunnel to `attached` (a `scrape` of its /metrics, or a call) from `source` has no
        place now, in the 503's words (refused and counted); None: it has one. A scrape has
        places of its own: the metrics credential is handed to whoever scrapes."""
        peer = attached.peer
        held = attached.metrics_tunnels if scrape else attached.tunnels
        most = (
            self.limits.max_metrics_tunnels_per_peer if scrape else self.limits.max_tunnels_per_peer
        )
        if held >= most:
            what = "metrics tunnels" if scrape else "tunnels"
            key = "metrics-full" if scrape else "peer-full"
            self._refuse(key, "refused a tunnel to %s: its %d %s are open", peer, held, what)
            return f"peer {peer} has {held} {what} open"
        if self._tunnels >= self.limits.max_tunnels:
            self._refuse("full", "refused a tunnel to %s: %d tunnels open", peer, self._tunnels)
            return f"this relay has {self._tunnels} tunnels open"
        share = min(self.limits.max_tunnels_per_peer_per_source, self.limits.max_tunnels_per_peer)
        # the others' share of its callers' places kept for them
        if not scrape and attached.callers[source] >= share:
            self._refuse(
                "peer-source-full", "refused a tunnel from %s to %s: its share is open", where, peer
            )
            return f"{share} tunnels to peer {peer} from your address"
        if self._source_tunnels[source] >= self.limits.max_tunnels_per_source:
            self._refuse("source-full", "refused a tunnel from %s: its source's are open", where)
            return f"{self._source_tunnels[source]} tunnels from your address"
        return None

    def _take(self, attached: Attached, scrape: bool, source: str) -> None:
        """A tunnel to `attached` from `source` takes its places (`_full` found them)."""
        if scrape:
            attached.metrics_tunnels += 1
        else:
            attached.tunnels += 1
            attached.callers[source] += 1
        self._tunnels += 1
        self._source_tunnels[source] += 1
        self.tunnels_gauge.set(self._tunnels)

    def _give_back(self, attached: Attached, scrape: bool, source: str) -> None:
        """The places `_take` took, given back as the tunnel ends."""
        if scrape:
            attached.metrics_tunnels -= 1
        else:
            attached.tunnels -= 1
            release(attached.callers, source)
        self._tunnels -= 1
        release(self._source_tunnels, source)
        self.tunnels_gauge.set(self._tunnels)

    def _credential(self, head: Head) -> str | None:
        """The peer a request's credential names ("": none, the metrics credential, good for
        any peer's metrics address only); None when it has no credential this relay takes."""
        creds = proxy_user(head.headers.get("proxy-authorization", ""))
        user, password = creds or ("", "")
        if self.token is None:
            return user  # an open relay: the user names the peer, or none is named
        if same(password, metrics_credential(self.token)):
            return ""
        if creds is not None and user and same(password, relay_credential(self.token, user)):
            return user
        return None

    def _route(self, peer: str, target: str) -> tuple[Attached, str]:
        """The attached peer and which of its servers (`GRPC`, `METRICS`) `target` is: the named
        `peer`'s announced gRPC or metrics address; with no peer named, the one peer that
        announced `target` as its metrics address. `_Refused` otherwise."""
        key = address_key(target)
        if peer:
            attached = self._peers.held.get(peer)
            if attached is None:
                raise _Refused(502, "unknown", f"peer {peer[:64]} is not attached to this relay")
            for kind, announced in attached.keys.items():
                if key is not None and key == announced:
                    return attached, kind
            raise _Refused(
                403,
                "target",
                f"peer {peer} announced no such address (only its "
                "gRPC and metrics addresses are carried)",
            )
        found = [a for a in self._peers.held.values() if key is not None and a.keys[METRICS] == key]
        if not found:
            raise _Refused(502, "unknown", "no peer attached to this relay serves metrics there")
        if len(found) > 1:  # two homes' LAN addresses may be the same: never the wrong peer
            names = ", ".join(sorted(a.peer for a in found)[:4])
            why = f"peers {names} all announce metrics there: give them distinct --metrics-port"
            raise _Refused(409, "ambiguous", why)
        return found[0], METRICS

    async def _open(self, attached: Attached, kind: str) -> Stream | None:
        """Ask `attached` for a data connection to its server `kind`; it, or None when none came
        in time."""
        call = secrets.token_hex(16)
        future: asyncio.Future[Stream] = asyncio.get_running_loop().create_future()
        self._calls[call] = (attached.peer, future)
        self._expected[attached.source] += 1  # its data connection's head: the data pool
        opened: Stream | None = None
        try:
            await attached.send(f"OPEN {call} {kind}", self.limits.open_timeout_s)
            opened = await within(future, self.limits.open_timeout_s)
            return opened
        except (ConnectionError, OSError, TimeoutError):
            return None
        finally:
            del self._calls[call]
            release(self._expected, attached.source)
            if not future.done():
                future.cancel()  # a data connection coming later is refused
            elif opened is None and not future.cancelled() and future.exception() is None:
                # Handed over, but not to the tunnel: it came in the pass its wait timed out,
                # or as the relay stopped. Closed, or it would stay open outside every count.
                future.result()[1].transport.abort()

    def _data(
        self, head: Head, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, where: object
    ) -> bool:
        """A peer's data connection: handed to the tunnel waiting for it (True), else refused."""
        call = head.target
        waiting = self._calls.get(call)
        proof = head.headers.get("authorization", "").removeprefix("Swarm ")
        if waiting is None or waiting[1].done():
            self._refuse("data", "refused a data connection from %s: no such call", where)
            return False
        if self.token is not None and not same(proof, data_proof(self.token, call)):
            self._refuse("data", "refused a data connection from %s: wrong proof", where)
            return False
        waiting[1].set_result((reader, writer))
        return True
