"""A NAT'd peer's side of a relay (`swarm.relay.server`): it keeps one control connection to a
relay, and for each call the relay carries to it opens a data connection back to the relay and
splices it to its own gRPC server. Every connection is one the peer opened itself, so a router
that drops inbound connections stops none of them.

`Attachment` chooses the first relay of `relays()` that accepts it (the one that last failed is
tried last), and re-chooses when that relay dies, refuses it, or goes silent (it pings every few
seconds), pausing between rounds (a `Backoff`); `on_change` hears the relay it is reached
through, or None. A relay that ends a live attachment (a restart, a blip, its own key attaching
elsewhere) is tried again first, once: the peer stays where it is reached, rather than moving to
whichever relay was announced last (a token holder's, say).

Each attach is signed with the peer's key (`swarm.relay.identity.AttachKey`: its certificate's,
or one made at its start), over the relay's address as dialled and its nonce: the relay binds
the attachment to that key.

Each call the relay asks for names what it is for, `grpc` or `metrics`, never an address: the
peer dials only its own gRPC server or its own /metrics, so neither a relay nor whoever poses as
one can make it a way into its LAN.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from swarm.deadline import within
from swarm.ops.printable import shown
from swarm.ops.rated import RatedLog
from swarm.policy.backoff import Backoff
from swarm.relay.auth import attach_proof, data_proof
from swarm.relay.copier import splice
from swarm.relay.identity import AttachKey, challenge
from swarm.relay.limits import METRICS_TUNNELS
from swarm.relay.wire import PROTOCOL, close

__all__ = [
    "GRPC",
    "METRICS",
    "NEW_PER_ROUND",
    "Attachment",
    "Pauses",
    "split_host_port",
]

log = logging.getLogger(__name__)

#: Relays a round tries beyond those listed at its start: announced since it began.
NEW_PER_ROUND = 4
#: The most of a relay's refusal said (the relay's own words: whoever runs it writes them).
MAX_REFUSAL_CHARS = 200

GRPC, METRICS = "grpc", "metrics"
"""What a relay's call is for (`OPEN call KIND`): this peer's gRPC server, or its /metrics."""


class Pauses(Protocol):
    """The pause between rounds of relays: a `swarm.policy.backoff.Backoff` (by default 0.5 s
    doubling to 30 s, jittered by a fifth: `Backoff(0.5, 30)`)."""

    def next(self) -> float: ...

    def reset(self) -> None: ...


class _Refused(Exception):
    """The relay answered, and refused."""


def split_host_port(address: str) -> tuple[str, int]:
    """(host, port) of `host:port` (an IPv6 host in brackets); ValueError when it is not one."""
    host, colon, port = address.rpartition(":")
    digits = port.isascii() and port.isdigit()  # "²" is a digit to `isdigit`, none to `int`
    if not colon or not host or not digits or not 0 < int(port) < 1 << 16:
        raise ValueError(f"{address!r} is not host:port (a port 1-65535)")
    return host.strip("[]"), int(port)


class Attachment:
    """Keeps `peer` attached to one relay of `relays()` and carries the relay's calls to
    `local_address` (this peer's own gRPC server). `address`: what this peer announces (the
    relay shows it; default `local_address`). `local_metrics`: its own /metrics, where a relayed
    scrape is carried ("": none), announced at `metrics_address` (default `local_metrics`).
    `key`: what it proves who it is with (default: a fresh key of its own)."""

    def __init__(
        self,
        peer: str,
        token: str | None,
        local_address: str,
        relays: Callable[[], Sequence[str]],
        on_change: Callable[[str | None], None],
        *,
        address: str = "",
        local_metrics: str = "",
        metrics_address: str = "",
        pauses: Pauses | None = None,
        timeout_s: float = 5.0,
        dead_after_s: float = 35.0,
        max_tunnels: int = 256,
        chunk_bytes: int = 256 * 1024,
        key: AttachKey | None = None,
    ) -> None:
        self.peer, self.token, self.local_address = peer, token or None, local_address
        self.key = key or AttachKey.fresh()
        self.address = address or local_address
        self.local_metrics = local_metrics
        self.metrics_address = (metrics_address or local_metrics) if local_metrics else ""
        self._targets = {GRPC: local_address, METRICS: local_metrics}
        self._relays, self._on_change = relays, on_change
        self._pauses: Pauses = pauses or Backoff(0.5, 30.0)
        self.timeout_s, self.dead_after_s = timeout_s, dead_after_s
        self.max_tunnels, self.chunk_bytes = max_tunnels, chunk_bytes
        self._relay: str | None = None
        # The source address the relay saw the attachment come from (`OK ip`): this peer's
        # router's public address, a failure domain (`swarm.policy.domains`); "": not said.
        self.seen_from = ""
        self._last_failed: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._tunnels: set[asyncio.Task[None]] = set()  # calls to its gRPC server
        self._scrapes: set[asyncio.Task[None]] = set()  # to its /metrics
        # a round in which no relay took it, said at WARNING (each relay's try is INFO)
        self._unattached = RatedLog(log, every_s=60.0)
        self._refused = RatedLog(log, every_s=60.0)  # a relay's refusal: the round says each
        self._full = RatedLog(log, every_s=60.0)  # a call past `max_tunnels`, not opened
        # a relayed call's data connection back to the relay that failed (its caller got a 504)
        self._no_data = RatedLog(log, every_s=60.0)

    @property
    def relay(self) -> str | None:
        """The relay this peer is reached through now, or None."""
        return self._relay

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"attachment-{self.peer}")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._tunnels, *self._scrapes) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None
        self._set(None)

    def _set(self, relay: str | None) -> None:
        if relay != self._relay:
            self._relay = relay
            try:
                self._on_change(relay)
            except Exception:  # what is told of it fails, not the attachment: it serves on
                log.exception("%s: telling of relay %s failed", self.peer, relay)

    def _next(self, tried: set[str], first: list[str]) -> str | None:
        """The relay to try next this round: the first not tried yet of those listed at its
        start (`first`), then of `relays()` as listed now, the one that last failed last in
        each; None when every one was, or when the round has tried `NEW_PER_ROUND` more than it
        began with. Relays announced since the round began are tried in it (they arrive one by
        one at a peer's start), but a flood of them (a token holder announcing a new one each
        moment) neither keeps the round from its end nor starves those listed before."""
        if len(tried) >= len(first) + NEW_PER_ROUND:
            return None
        for relays in (list(first), self._listed()):
            if self._last_failed in relays and len(relays) > 1:  # the others first
                relays.remove(self._last_failed)
                relays.append(self._last_failed)
            untried = next((r for r in relays if r not in tried), None)
            if untried is not None:
                return untried
        return None

    def _listed(self) -> list[str]:
        """`relays()` now, each once; none when whoever lists them fails (not the end)."""
        try:
            return list(dict.fromkeys(self._relays()))
        except Exception:
            log.exception("%s: could not list relays", self.peer)
            return []

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        retried: set[str] = set()  # tried again at once after it ended a live attachment
        while True:
            # One round: each relay listed at most once. The list is read again after each
            # relay, so a relay announced since the round began (as the relays' announcements
            # arrive one by one at a peer's start) is tried in it too: a lost relay is followed
            # at once by another, with no pause and no moment announced without a relay (nobody
            # could call the peer then), still announced through the lost one meanwhile.
            tried: set[str] = set()
            first = self._listed()  # as the round begins
            failed: dict[str, str] = {}  # why each relay of the round did not take it
            again: str | None = None  # a relay that ended a live attachment: tried first, once
            while (relay := again or self._next(tried, first)) is not None:
                again = None
                tried.add(relay)
                try:
                    reader, writer = await within(self._attach(relay), self.timeout_s)
                except _Refused as e:  # the relay says why (a wrong key, a certificate
                    # not naming this peer, another key holding its id): the operator's to fix.
                    # Its words are whoever runs it: escaped, cut short, said once a minute.
                    said = shown(str(e)[:MAX_REFUSAL_CHARS])
                    self._refused.warning(
                        "refused", "%s: relay %s refused it: %s", self.peer, relay, said
                    )
                    self._last_failed, failed[relay] = relay, f"refused: {said}"
                    continue
                except (OSError, TimeoutError, ValueError) as e:
                    log.info("%s: relay %s: not attached: %s", self.peer, relay, e or type(e))
                    self._last_failed, failed[relay] = relay, str(e or type(e).__name__)
                    continue
                except Exception as e:  # one relay's fault (a bug's, even) ends no attachment
                    log.warning(
                        "%s: relay %s: not attached: %s: %s", self.peer, relay, type(e).__name__, e
                    )
                    self._last_failed, failed[relay] = relay, f"{type(e).__name__}: {e}"
                    continue
                log.info("%s: attached to relay %s", self.peer, relay)
                self._set(relay)
                since = loop.time()
                ended = False  # by the relay (closed, reset), not gone silent
                try:
                    await self._serve(relay, reader, writer)
                except (OSError, ValueError) as e:
                    ended = True
                    log.info("%s: relay %s lost: %s", self.peer, relay, e or type(e).__name__)
                except TimeoutError:
                    log.info("%s: relay %s lost: silent", self.peer, relay)
                finally:
                    await close(writer)
                if ended and relay not in retried and relay in self._listed():
                    retried.add(relay)
                    tried.discard(relay)
                    again = relay
                    continue
                self._last_failed = relay
                if loop.time() - since > self.dead_after_s:
                    self._pauses.reset()  # it served a while: its end is news, not a pattern
            if not tried:
                log.debug("%s: no relay to attach to", self.peer)
            pause = self._pauses.next()
            if tried and failed.keys() == tried:  # none took it: nobody can call this peer
                self._unattached.warning(
                    "round",
                    "%s: no relay took it (%s); trying again in %.0f s",
                    self.peer,
                    "; ".join(f"{r}: {why}" for r, why in failed.items()),
                    pause,
                )
            self._set(None)  # no relay of this round holds it
            retried.clear()
            await asyncio.sleep(pause)

    async def _attach(self, relay: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection(*split_host_port(relay))
        try:
            metrics = f"X-Swarm-Metrics: {self.metrics_address}\r\n" if self.metrics_address else ""
            writer.write(
                f"ATTACH {self.peer} {PROTOCOL}\r\nX-Swarm-Address: {self.address}\r\n"
                f"X-Swarm-Relay: {relay}\r\n{self.key.header()}\r\n"
                f"X-Swarm-Seen-From: ?\r\n{metrics}\r\n".encode()
            )
            verb, _, nonce = (await reader.readline()).decode("latin-1").strip().partition(" ")
            if verb != "NONCE":
                raise _Refused(f"{verb} {nonce}".strip() or "closed")
            signed = self.key.sign(challenge(self.peer, relay, nonce))
            writer.write(f"PROOF {attach_proof(self.token, self.peer, nonce)} {signed}\n".encode())
            answer = (await reader.readline()).decode("latin-1").strip()
            verb, _, seen = answer.partition(" ")
            if verb != "OK":
                raise _Refused(answer or "closed")
            self.seen_from = seen  # "" from a relay that does not say
        except BaseException:
            await close(writer)
            raise
        return reader, writer

    async def _serve(
        self, relay: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Answer the relay's pings and open a data connection per call, until it ends."""
        while True:
            line = await within(reader.readline(), self.dead_after_s)
            verb, _, rest = line.decode("latin-1").strip().partition(" ")
            call, _, kind = rest.partition(" ")
            if verb == "PING":
                writer.write(b"PONG\n")
                await within(writer.drain(), self.dead_after_s)
            elif verb == "OPEN" and not self._targets.get(kind or GRPC):
                # Only its own two servers, by name: an address, a port, or a kind this peer
                # does not serve (a metrics call to a peer without /metrics) opens nothing.
                log.debug("%s: relay %s asked for %.40r: not served", self.peer, relay, kind)
            elif verb == "OPEN" and call:
                # A scrape has places of its own (`METRICS_TUNNELS`), as at the relay: the
                # metrics credential is handed to whoever scrapes.
                tunnels = self._scrapes if kind == METRICS else self._tunnels
                most = METRICS_TUNNELS if kind == METRICS else self.max_tunnels
                if len(tunnels) >= most:  # its caller hears "did not answer": the cause here
                    self._full.info(
                        kind or GRPC,
                        "%s: relay %s asked for a call past its %d carried at once (%s): "
                        "not opened",
                        self.peer,
                        relay,
                        most,
                        kind or GRPC,
                    )
                    continue
                task = asyncio.create_task(self._tunnel(relay, call, self._targets[kind or GRPC]))
                tunnels.add(task)
                task.add_done_callback(tunnels.discard)
            elif verb != "OPEN":
                raise ValueError(f"the relay said {line[:40]!r}" if line else "closed")

    async def _tunnel(self, relay: str, call: str, target: str) -> None:
        """One call: this peer's server at `target` (its gRPC or its /metrics), spliced to a data
        connection to the relay."""
        try:
            local = await within(asyncio.open_connection(*split_host_port(target)), self.timeout_s)
        except (OSError, TimeoutError) as e:
            log.warning("%s: own server %s did not answer a relayed call: %s", self.peer, target, e)
            return
        try:
            remote = await within(asyncio.open_connection(*split_host_port(relay)), self.timeout_s)
        except (OSError, TimeoutError) as e:
            await close(local[1])
            self._no_data.warning(
                relay,
                "%s: a relayed call's data connection to relay %s failed (%s): its caller got no "
                "answer; the relay takes the attachment but not new connections from here",
                self.peer,
                relay,
                e or type(e).__name__,
            )
            return
        remote[1].write(
            f"DATA {call} {PROTOCOL}\r\nAuthorization: Swarm {data_proof(self.token, call)}"
            "\r\n\r\n".encode()
        )
        await splice(local, remote, self.chunk_bytes)
