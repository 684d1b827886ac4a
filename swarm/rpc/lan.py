"""Peers on one LAN reach each other directly (issue 51, item 7): a relayed peer
(`relay://PEER@RELAY/ADDRESS`, `swarm.net.paths`) is dialled at its own announced ADDRESS, past
its relay, once that address has answered as PEER to this process.

A NAT'd peer announces the address it has on its LAN, which a caller behind the same router can
dial as it is; from anywhere else it reaches nobody, or, worse, another machine that has the same
private address in the caller's own home. So the choice is made per relayed address, by trying:
in the background (`Shortcuts.direct` starts the probe, the call goes on through the relay
meanwhile), StageService.Info with the swarm's token straight to ADDRESS, within `PROBE_S`, and
the answer must name PEER (with TLS on, the handshake checks the same identity as through the
relay: the one dialer names it for both, `swarm.net.dial`). An address that answered as its peer
is dialled directly until a call over it fails (`lost`); one that did not, or failed, is probed
again after `RETRY_S`. The relay path is never touched: a caller that cannot reach the address
keeps calling through the relay as before.

Only a neighbour is probed (issue 64 item 6): a process probes a relayed peer's address only when
its `scope` says the two share an observed public address (the one each one's relay saw its
attachment come from: one router). Anywhere else the announced address is a stranger's word,
and a probe of it would carry the swarm's token to whatever answers there (this host's loopback,
a service on the caller's own LAN). The process's own `SHORTCUTS` probes nobody until a stage
server behind NAT gives it its scope (`stage_server.peer.reachability.PeerPath.neighbour`): a
scheduler's trainer, or any caller not itself relayed, never probes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import grpc

from swarm.net import dial, paths
from swarm.ops.rated import RatedLog
from swarm.proto import stage_pb2 as pb
from swarm.proto import stage_pb2_grpc

__all__ = [
    "PROBE_S",
    "RETRY_S",
    "SHORTCUTS",
    "Prober",
    "Scope",
    "Shortcuts",
    "answers_as_peer",
    "everyone",
    "nobody",
]

log = logging.getLogger(__name__)

PROBE_S = 1.0
"""A probe's deadline: a LAN answers in milliseconds; an address elsewhere never does."""
RETRY_S = 60.0
"""How long a relayed address that did not answer as its peer (or failed) is left to the relay."""

Prober = Callable[[str, str | None], Awaitable[bool]]
"""Whether a relayed address's announced address answers as its peer (address, token)."""
Scope = Callable[[str], bool]
"""Whether the peer of this id shares this process's observed public address (one router)."""


def everyone(peer: str) -> bool:
    """A scope that probes every relayed peer (a test's, or `--relay-only`'s opposite)."""
    return True


def nobody(peer: str) -> bool:
    """A scope that probes no relayed peer: a process with no observed public address of its
    own, which can share none."""
    return False


async def answers_as_peer(address: str, token: str | None) -> bool:
    """StageService.Info straight to `address`'s announced address (past its relay), with the
    swarm's token: True when the peer that answers is the one the address names."""
    path = paths.parse(address)
    channel = dial.channel(address, token=token, direct=True)
    try:
        info = stage_pb2_grpc.StageServiceStub(channel).Info
        answer: pb.StageInfoResponse = await info(pb.StageInfoRequest(), timeout=PROBE_S)
    except grpc.RpcError:
        return False
    finally:
        await channel.close()
    return answer.peer == path.peer


class Shortcuts:
    """Which relayed addresses this process dials directly. `enabled` False: none (every call to
    a relayed peer through its relay, as before: `--relay-only`); `scope`: which peers' addresses
    are probed at all (its neighbours'; settable once the process knows them)."""

    def __init__(
        self,
        prober: Prober = answers_as_peer,
        *,
        retry_s: float = RETRY_S,
        clock: Callable[[], float] = time.monotonic,
        enabled: bool = True,
        scope: Scope = everyone,
    ) -> None:
        self.enabled, self.scope = enabled, scope
        self._prober, self._retry_s, self._clock = prober, retry_s, clock
        self._direct: set[str] = set()
        self._retry_at: dict[str, float] = {}
        self._probing: dict[str, asyncio.Task[None]] = {}
        self._broken = RatedLog(log, every_s=60.0, clock=clock)

    def direct(self, address: str, token: str | None) -> bool:
        """Whether to dial `address` past its relay now. A relayed address not probed yet (or
        whose retry time has come) is probed in the background, on the running loop (none: not
        probed); until it answers as its peer it is dialled through its relay."""
        if not self.enabled or not address.startswith(paths.SCHEME):
            return False
        try:
            peer = paths.parse(address).peer or ""
        except ValueError:
            return False
        if not self.scope(peer):
            return False  # not a neighbour: its announced address is neither probed nor dialled
        if address in self._direct:
            return True
        if self._clock() < self._retry_at.get(address, 0.0):
            return False
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        probing = self._probing.get(address)
        if probing is None or probing.get_loop() is not loop:  # none under way on this loop
            task = loop.create_task(self._probe(address, token))
            self._probing[address] = task
            task.add_done_callback(lambda _: self._probing.pop(address, None))
        return False

    def lost(self, address: str) -> None:
        """A call dialled directly to `address` failed: back to its relay, probed again later."""
        if address in self._direct:
            self._direct.discard(address)
            self._retry_at[address] = self._clock() + self._retry_s
            log.info("%s: its LAN address failed; calling it through its relay again", address)

    async def _probe(self, address: str, token: str | None) -> None:
        try:
            reached = await self._prober(address, token)
        except Exception as e:  # a probe that breaks leaves the relay path, as one that fails
            # Not a peer that did not answer (the prober says that with False): a bug, or a dial
            # set up wrong, which would keep every LAN shortcut off unseen.
            self._broken.warning(
                type(e).__name__,
                "probing %s's LAN address broke (%s: %s); calling it through its relay",
                address,
                type(e).__name__,
                e,
            )
            log.debug("probing %s's LAN address broke", address, exc_info=True)
            reached = False
        if reached:
            self._direct.add(address)
            self._retry_at.pop(address, None)
            log.info("%s: its LAN address answers as the peer; calling it directly", address)
        else:
            self._retry_at[address] = self._clock() + self._retry_s

    async def probed(self) -> None:
        """Once the probes under way have ended."""
        await asyncio.gather(*self._probing.values(), return_exceptions=True)

    async def close(self) -> None:
        """Cancel the probes under way (their owner is closing)."""
        probing, self._probing = self._probing, {}
        for task in probing.values():
            task.cancel()
        await asyncio.gather(*probing.values(), return_exceptions=True)


SHORTCUTS = Shortcuts(scope=nobody)
"""The process's own: every stage client of the process follows one verdict per address. It
probes nobody until given a scope (a stage server behind NAT: its neighbours)."""
