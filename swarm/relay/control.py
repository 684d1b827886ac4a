"""A relay's attached peers (`Peers`): each peer id held by one control connection, bound to the
key that proved it (`swarm.relay.identity`), counted in all and per source (`swarm.relay.limits`),
pinged, and forgotten when it ends. `swarm.relay.server` hands it every ATTACH (`Peers.serve`) and
routes tunnels to what it holds (`Peers.held`).

One id, one live key: an attach under an id held by another key is refused while the holder
answers a ping within `probe_s` (a token holder posing as a live peer, or its twin), and takes the
id over when it does not (the peer restarted with a new key; its old connection is dead). The same
key attaching again (a reconnect) replaces its old connection at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections import Counter as Tally
from collections.abc import Callable

from prometheus_client import Counter, Gauge

from swarm.deadline import within
from swarm.net.peer_ids import is_peer_id
from swarm.relay.attach import GRPC, METRICS
from swarm.relay.auth import attach_proof, same
from swarm.relay.identity import Unproven, challenge, verify
from swarm.relay.limits import RelayLimits, release, source_of
from swarm.relay.wire import Head, address_key

__all__ = ["Attached", "Peers"]

log = logging.getLogger(__name__)

Refuse = Callable[..., None]
"""`RelayServer._refuse`: (reason key, log message, *args)."""
Hold = Callable[[str, bool], contextlib.AbstractContextManager[None]]
"""`RelayServer._head`: holds a request head's slot for (source, expected)."""


class Attached:
    """A peer's control connection, who made it (`identity`, from where: `source`), what it
    holds, and the addresses it announced (its gRPC server's, its /metrics' or "")."""

    def __init__(
        self, peer: str, address: str, metrics: str, writer: asyncio.StreamWriter, identity: str
    ) -> None:
        self.peer, self.address, self.metrics, self.writer = peer, address, metrics, writer
        self.identity, self.source = identity, source_of(writer.get_extra_info("peername"))
        self.keys = {GRPC: address_key(address), METRICS: address_key(metrics)}
        self.tunnels = 0  # to its gRPC server
        self.metrics_tunnels = 0  # to its /metrics (`RelayLimits.max_metrics_tunnels_per_peer`)
        self.callers: Tally[str] = Tally()  # its tunnels by caller's source (`source_of`)
        self.ponged = asyncio.Event()  # a PONG came (`Peers.answers` waits for one)

    async def send(self, line: str, timeout_s: float) -> None:
        self.writer.write(line.encode() + b"\n")
        await within(self.writer.drain(), timeout_s)


class Peers:
    """The peers attached to one relay (`held`: id -> `Attached`). `limits`: the relay's, as
    sized at its start; `addresses`: what it is dialled by (an attach signs one of them)."""

    def __init__(
        self,
        token: str | None,
        ca: bytes | None,
        limits: Callable[[], RelayLimits],
        addresses: set[str],
        refuse: Refuse,
        hold: Hold,
        gauge: Gauge,
        attaches: Counter,
    ) -> None:
        self._token, self._ca, self._limits, self._addresses = token, ca, limits, addresses
        self._refuse, self._head, self.gauge, self.attaches = refuse, hold, gauge, attaches
        self.held: dict[str, Attached] = {}
        self._sources: Tally[str] = Tally()

    async def serve(
        self, head: Head, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, where: object
    ) -> None:
        peer, address = head.target, head.headers.get("x-swarm-address", "")
        metrics, relay = head.headers.get("x-swarm-metrics", ""), head.headers.get("x-swarm-relay")
        source = source_of(where)
        refusal = self._refusal(peer, source, relay)
        if refusal is not None:
            self._refuse(refusal[0], "refused to attach %.64r from %s: %s", peer, where, refusal[1])
            writer.write(f"ERR {refusal[1]}\n".encode())
            return
        nonce = secrets.token_hex(16)
        writer.write(f"NONCE {nonce}\n".encode())
        with self._head(source, False):  # until the proof is in: a stranger's silence holds it
            line = await within(reader.readline(), self._limits().head_timeout_s)
        verb, _, rest = line.decode("latin-1").strip().partition(" ")
        proof, _, signature = rest.partition(" ")
        if verb != "PROOF" or (
            self._token is not None and not same(proof, attach_proof(self._token, peer, nonce))
        ):
            self._refuse("attach", "refused to attach %.64r from %s: wrong proof", peer, where)
            writer.write(b"ERR wrong proof: this relay needs the swarm's token\n")
            return
        try:
            message = challenge(peer, relay or "", nonce)
            identity = verify(head.headers, peer, message, signature, self._ca)
        except Unproven as e:
            self._refuse("identity", "refused to attach %.64r from %s: %s", peer, where, e)
            writer.write(f"ERR not {peer}: {e}\n".encode())
            return
        old = self.held.get(peer)
        if old is not None and old.identity != identity:
            alive = await self._probe(old, source)
            now = self.held.get(peer)  # another key may have taken a dead one's place meanwhile
            if alive or (now is not None and now is not old and now.identity != identity):
                # Another key under a live peer's id: a token holder posing as it, or a twin.
                self._refuse("taken", "refused to attach %.64r from %s: held", peer, where)
                writer.write(f"ERR {peer} is attached here already, by another key\n".encode())
                return
        refusal = self._refusal(peer, source, relay)  # again: others came meanwhile
        if refusal is not None:
            self._refuse(refusal[0], "refused to attach %.64r from %s: %s", peer, where, refusal[1])
            writer.write(f"ERR {refusal[1]}\n".encode())
            return
        old = self.held.get(peer)
        if old is not None:  # its own key again (restarted, reconnected) or a dead one: replaced
            old.writer.close()
            self.detached(old)
        attached = Attached(peer, address, metrics, writer, identity)
        self.held[peer] = attached
        self._sources[attached.source] += 1
        self.gauge.set(len(self.held))
        self.attaches.inc()
        # A peer that asks is told the address its attachment came from: its router's public
        # one, the failure domain it announces (`PeerAnnouncement.public_address`).
        ip = where[0] if isinstance(where, tuple) and where else ""
        seen = f" {ip}" if "x-swarm-seen-from" in head.headers and ip else ""
        writer.write(f"OK{seen}\n".encode())
        log.info("relay: peer %s attached from %s (announced %s)", peer, where, address)
        pinger = asyncio.create_task(self._ping(attached))
        try:
            while True:
                line = await within(reader.readline(), self._limits().dead_after_s)
                if line.strip() != b"PONG":
                    break  # end of stream, or something no peer sends
                attached.ponged.set()
        finally:
            pinger.cancel()
            if self.detached(attached):
                log.info("relay: peer %s detached", peer)

    def _refusal(self, peer: str, source: str, relay: str | None) -> tuple[str, str] | None:
        """Why an attach as `peer` from `source`, dialling this relay as `relay`, is refused
        before its proof (its reason's key and words), or None."""
        if not is_peer_id(peer):
            return "attach", "not a peer id"
        if relay is None or relay not in self._addresses:
            known = ", ".join(sorted(self._addresses)) or "no address yet"
            return "attach", f"this relay is {known}, not {relay!r}: dial it as announced"
        attached = self.held.get(peer)
        if attached is None and len(self.held) >= self._limits().max_peers:
            return "peers-full", f"this relay carries {len(self.held)} peers, its most"
        if (attached is None or attached.source != source) and self._sources[
            source
        ] >= self._limits().max_peers_per_source:
            return "peers-full", f"this relay carries {self._sources[source]} peers from there"
        return None

    def detached(self, attached: Attached) -> bool:
        """Forget `attached` if it is still the one under its id; whether it was."""
        if self.held.get(attached.peer) is not attached:
            return False
        del self.held[attached.peer]
        release(self._sources, attached.source)
        self.gauge.set(len(self.held))
        return True

    async def _probe(self, attached: Attached, source: str) -> bool:
        """`answers`, the newcomer's head slot held meanwhile: its source's probes are counted."""
        with self._head(source, False):
            return await self.answers(attached)

    async def answers(self, attached: Attached) -> bool:
        """Whether `attached` answers a ping now: a live attachment is never unseated by another
        key; one that does not answer within `probe_s` is dead (its peer restarted)."""
        attached.ponged.clear()
        try:
            await attached.send("PING", self._limits().probe_s)
            await within(attached.ponged.wait(), self._limits().probe_s)
        except (ConnectionError, OSError, TimeoutError):
            return False
        return True

    async def _ping(self, attached: Attached) -> None:
        try:
            while True:
                await asyncio.sleep(self._limits().ping_s)
                await attached.send("PING", self._limits().dead_after_s)
        except (ConnectionError, OSError, TimeoutError):
            attached.writer.close()  # the reading side then ends
