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
be replayed. What one connection can hold (`RelayLimits`): a request head is read within a time
and a size; peers, tunnels per peer and tunnels in all are counted; a tunnel reads at most a
bounded amount ahead of the side it writes to. Refusals are counted by reason and logged rated.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from swarm.net.paths import relay_credential
from swarm.ops.rated import RatedLog
from swarm.relay.attach import GRPC, METRICS
from swarm.relay.auth import (
    attach_proof,
    data_proof,
    metrics_credential,
    proxy_user,
    same,
)
from swarm.relay.wire import (
    PROTOCOL,
    Head,
    HeadError,
    address_key,
    close,
    origin_form,
    read_head,
    splice,
)

__all__ = ["RelayLimits", "RelayServer"]

log = logging.getLogger(__name__)

Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]
_PEER_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")  # as stage_server.peer.identity makes them
_LINGER_S = 0.5  # how long a refused request's remaining bytes are read before closing


@dataclass(frozen=True)
class RelayLimits:
    max_peers: int = 256  # peers attached at once
    max_tunnels_per_peer: int = 64  # a peer's concurrent tunnels (a gRPC channel uses one)
    max_tunnels: int = 1024  # tunnels in all (two descriptors each, and the peer's one)
    max_heads: int = 128  # connections still sending their request head
    head_timeout_s: float = 10.0  # to send a request head (and an attach's proof)
    max_head_bytes: int = 8192
    open_timeout_s: float = 10.0  # for the peer to open a tunnel's data connection
    ping_s: float = 10.0  # how often an attached peer is pinged
    dead_after_s: float = 35.0  # an attached peer silent this long is dropped
    chunk_bytes: int = 256 * 1024  # a splice's read; with the stream buffers, its memory bound


class _Attached:
    """A peer's control connection, what it holds, and the addresses it announced (its gRPC
    server's, its /metrics' or "")."""

    def __init__(self, peer: str, address: str, metrics: str, writer: asyncio.StreamWriter) -> None:
        self.peer, self.address, self.metrics, self.writer = peer, address, metrics, writer
        self.keys = {GRPC: address_key(address), METRICS: address_key(metrics)}
        self.tunnels = 0

    async def send(self, line: str, timeout_s: float) -> None:
        self.writer.write(line.encode() + b"\n")
        await asyncio.wait_for(self.writer.drain(), timeout_s)


class _Refused(Exception):
    """A tunnel refused: its answer's `status` and `reason`, counted under `key`."""

    def __init__(self, status: int, key: str, reason: str) -> None:
        super().__init__(reason)
        self.status, self.key, self.reason = status, key, reason


class RelayServer:
    """`await start(host, port)` -> the bound port; `await stop()`. `token` None: open (a
    trusted network); `registry`: where its metrics go; `refusals`: its refusal log, rated
    (strangers cause refusals at will; keyed by the refusal's reason), or None: at DEBUG."""

    def __init__(
        self,
        token: str | None,
        limits: RelayLimits | None = None,
        *,
        registry: CollectorRegistry | None = None,
        refusals: RatedLog | None = None,
    ) -> None:
        self.token = token or None
        self.limits = limits or RelayLimits()
        self._log = refusals
        registry = registry if registry is not None else CollectorRegistry()
        self.refused = Counter(
            "swarm_relay_refused_total",
            "Connections this relay refused, by reason",
            ["reason"],
            registry=registry,
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
        self._peers: dict[str, _Attached] = {}
        self._calls: dict[str, tuple[str, asyncio.Future[Stream]]] = {}
        self._tunnels = 0
        self._heads = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    @property
    def peers(self) -> dict[str, str]:
        """The attached peers and the addresses they announced."""
        return {p: a.address for p, a in self._peers.items()}

    @property
    def tunnels(self) -> int:
        """Tunnels open now, in all."""
        return self._tunnels

    def tunnels_of(self, peer: str) -> int:
        """Tunnels open now to `peer` (0 when it is not attached)."""
        attached = self._peers.get(peer)
        return attached.tunnels if attached is not None else 0

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._connected, host, port)
        bound = int(self._server.sockets[0].getsockname()[1])
        log.info("relay listening on %s:%d", host, bound)
        return bound

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for attached in list(self._peers.values()):
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
        if self._heads >= self.limits.max_heads:
            self._refuse(
                "busy", "refused a connection from %s: %d request heads pending", where, self._heads
            )
            return False
        self._heads += 1
        try:
            head = await asyncio.wait_for(
                read_head(reader, self.limits.max_head_bytes), self.limits.head_timeout_s
            )
        except HeadError as e:
            self._refuse("head", "refused a request from %s: %s", where, e.reason)
            await _answer(writer, e.status, e.reason)
            await _linger(reader)
            return False
        except TimeoutError:
            self._refuse(
                "slow", "dropped %s: no request head in %.0f s", where, self.limits.head_timeout_s
            )
            return False
        finally:
            self._heads -= 1
        if head.method == "CONNECT" or origin_form(head) is not None:
            await self._tunnel(head, reader, writer, where)
        elif head.method == "ATTACH" and head.version == PROTOCOL:
            await self._attach(head, reader, writer, where)
        elif head.method == "DATA" and head.version == PROTOCOL:
            return self._data(head, reader, writer, where)
        else:
            self._refuse("head", "refused %s: method %.16r", where, head.method)
            await _answer(writer, 405, "this relay takes CONNECT (or a proxy request for /metrics)")
        return False

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
            await _answer(writer, 407, "this relay needs the swarm's credential for the peer")
            return
        try:
            attached, kind = self._route(named, target)
            if forward and kind != METRICS:
                raise _Refused(403, "target", "only a peer's metrics take a plain HTTP request")
        except _Refused as e:
            self._refuse(e.key, "refused a tunnel from %s to %.64r: %s", where, target, e.reason)
            await _answer(writer, e.status, e.reason)
            return
        peer = attached.peer
        if attached.tunnels >= self.limits.max_tunnels_per_peer:
            self._refuse(
                "peer-full",
                "refused a tunnel to %s: its %d tunnels are open",
                peer,
                attached.tunnels,
            )
            await _answer(writer, 503, f"peer {peer} has {attached.tunnels} tunnels open")
            return
        if self._tunnels >= self.limits.max_tunnels:
            self._refuse("full", "refused a tunnel to %s: %d tunnels open", peer, self._tunnels)
            await _answer(writer, 503, f"this relay has {self._tunnels} tunnels open")
            return
        attached.tunnels += 1
        self._tunnels += 1
        self.tunnels_gauge.set(self._tunnels)
        try:
            data = await self._open(attached, kind)
            if data is None:
                self._refuse("no-data", "peer %s opened no connection for a tunnel", peer)
                await _answer(writer, 504, f"peer {peer} did not answer through this relay")
                return
            self.opened.inc()
            if forward:  # the request goes on to the peer's /metrics, which answers it
                data[1].write(forward)
            else:
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await splice((reader, writer), data, self.limits.chunk_bytes, self.carried.inc)
        finally:
            attached.tunnels -= 1
            self._tunnels -= 1
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

    def _route(self, peer: str, target: str) -> tuple[_Attached, str]:
        """The attached peer and which of its servers (`GRPC`, `METRICS`) `target` is: the named
        `peer`'s announced gRPC or metrics address; with no peer named, the one peer that
        announced `target` as its metrics address. `_Refused` otherwise."""
        key = address_key(target)
        if peer:
            attached = self._peers.get(peer)
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
        found = [a for a in self._peers.values() if key is not None and a.keys[METRICS] == key]
        if not found:
            raise _Refused(502, "unknown", "no peer attached to this relay serves metrics there")
        if len(found) > 1:  # two homes' LAN addresses may be the same: never the wrong peer
            names = ", ".join(sorted(a.peer for a in found)[:4])
            why = f"peers {names} all announce metrics there: give them distinct --metrics-port"
            raise _Refused(409, "ambiguous", why)
        return found[0], METRICS

    async def _open(self, attached: _Attached, kind: str) -> Stream | None:
        """Ask `attached` for a data connection to its server `kind`; it, or None when none came
        in time."""
        call = secrets.token_hex(16)
        future: asyncio.Future[Stream] = asyncio.get_running_loop().create_future()
        self._calls[call] = (attached.peer, future)
        try:
            await attached.send(f"OPEN {call} {kind}", self.limits.open_timeout_s)
            return await asyncio.wait_for(future, self.limits.open_timeout_s)
        except (ConnectionError, OSError, TimeoutError):
            return None
        except asyncio.CancelledError:  # stop(): a data connection already handed over is closed
            if future.done() and not future.cancelled():
                future.result()[1].transport.abort()
            raise
        finally:
            del self._calls[call]
            if not future.done():
                future.cancel()  # a data connection coming later is refused

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

    # -- a NAT'd peer's control connection -------------------------------------------------------
    async def _attach(
        self, head: Head, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, where: object
    ) -> None:
        peer, address = head.target, head.headers.get("x-swarm-address", "")
        metrics = head.headers.get("x-swarm-metrics", "")
        if not _PEER_ID.fullmatch(peer):
            self._refuse("attach", "refused to attach %.64r from %s: not a peer id", peer, where)
            writer.write(b"ERR not a peer id\n")
            return
        if peer not in self._peers and len(self._peers) >= self.limits.max_peers:
            self._refuse(
                "peers-full", "refused peer %.64r: %d peers attached", peer, len(self._peers)
            )
            writer.write(f"ERR this relay carries {len(self._peers)} peers, its most\n".encode())
            return
        nonce = secrets.token_hex(16)
        writer.write(f"NONCE {nonce}\n".encode())
        self._heads += 1  # until the proof is in: a stranger's silence holds a head's slot
        try:
            line = await asyncio.wait_for(reader.readline(), self.limits.head_timeout_s)
        finally:
            self._heads -= 1
        verb, _, proof = line.decode("latin-1").strip().partition(" ")
        if verb != "PROOF" or (
            self.token is not None and not same(proof, attach_proof(self.token, peer, nonce))
        ):
            self._refuse("attach", "refused to attach %.64r from %s: wrong proof", peer, where)
            writer.write(b"ERR wrong proof: this relay needs the swarm's token\n")
            return
        attached = _Attached(peer, address, metrics, writer)
        old = self._peers.get(peer)
        if old is not None:  # a restarted peer: the newer connection wins, the old may be dead
            old.writer.close()
        self._peers[peer] = attached
        self.peers_gauge.set(len(self._peers))
        # A peer that asks is told the address its attachment came from: its router's public
        # one, the failure domain it announces (`PeerAnnouncement.public_address`).
        source = where[0] if isinstance(where, tuple) and where else ""
        seen = f" {source}" if "x-swarm-seen-from" in head.headers and source else ""
        writer.write(f"OK{seen}\n".encode())
        log.info("relay: peer %s attached from %s (announced %s)", peer, where, address)
        pinger = asyncio.create_task(self._ping(attached))
        try:
            while True:
                line = await asyncio.wait_for(reader.readline(), self.limits.dead_after_s)
                if line.strip() != b"PONG":
                    break  # end of stream, or something no peer sends
        finally:
            pinger.cancel()
            if self._peers.get(peer) is attached:
                del self._peers[peer]
                self.peers_gauge.set(len(self._peers))
                log.info("relay: peer %s detached", peer)

    async def _ping(self, attached: _Attached) -> None:
        try:
            while True:
                await asyncio.sleep(self.limits.ping_s)
                await attached.send("PING", self.limits.dead_after_s)
        except (ConnectionError, OSError, TimeoutError):
            attached.writer.close()  # the reading side then ends


async def _answer(writer: asyncio.StreamWriter, status: int, reason: str) -> None:
    """An HTTP answer whose reason phrase says why (gRPC shows callers the status only)."""
    phrase = reason.replace("\r", " ").replace("\n", " ")
    body = phrase.encode() + b"\n"
    writer.write(
        f"HTTP/1.1 {status} {phrase}\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n".encode()
        + body
    )
    with contextlib.suppress(ConnectionError, OSError, TimeoutError):
        await asyncio.wait_for(writer.drain(), 1.0)


async def _linger(reader: asyncio.StreamReader) -> None:
    """Read and drop what the client still sends, briefly, before closing: a socket closed with
    unread bytes is reset, and the reset can overtake the answer it was sent."""
    try:
        async with asyncio.timeout(_LINGER_S):
            while await reader.read(64 * 1024):
                pass
    except (ConnectionError, OSError, TimeoutError):
        pass
