"""The replicas a sender routes to: the wiring's pool for each stage it sends to and one client
per replica, following the members it is told of. A trainer follows the coordinator's view of
every stage (each lease carries it); a replica on the push plane follows the route each request
carries for the stage after its own. Both go through `Routes.follow`, so a peer that left, moved
to another stage (rebalancing) or came back at another address is treated the same everywhere.

A replaced client is not closed at once: calls may still be in flight on it, so it is retired
and closed once their deadline has passed (`Retiring`)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Protocol

from swarm.errors import InvalidArgument
from swarm.job.config import JobConfig
from swarm.policy.speeds import known_speed
from swarm.policy.wiring import Wiring
from swarm.proto import stage_pb2 as pb
from swarm.rpc import lan
from swarm.rpc.causes import Causes
from swarm.rpc.lease import Replica
from swarm.rpc.route_clients import Path, Retiring, RouteClients
from swarm.rpc.stage_client import StageClient

__all__ = [
    "MAX_ADDRESS_CHARS",
    "MAX_ROUTE_MEMBERS",
    "ClientFactory",
    "Routes",
    "check_route",
    "members_of",
]

#: The most replicas a push's route may name for one stage: a pool's round takes no more
#: (`stage_server.averaging.slot.MAX_GROUP_SIZE`). Each one named is a client the receiver
#: makes on its event loop (and, behind NAT, a probe of its LAN address).
MAX_ROUTE_MEMBERS = 1024
#: The longest address, or peer id, a route may name: "host:port" (a host of up to 255), or a
#: relayed one with its peer id, its relay's address and its own (some 660 at the most); a
#: standalone swarm's ids are its addresses.
MAX_ADDRESS_CHARS = 1024


def check_route(route: Sequence[pb.Route], later: int) -> None:
    """Refuse (InvalidArgument) a push's route that names more stages than the `later` ones
    after its receiver, more than `MAX_ROUTE_MEMBERS` replicas of one, peers and addresses
    that do not pair, a throughput that is no speed (negative, or not finite), or a member no
    peer could be (an id or an address empty, too long, or not printable; a standalone swarm's
    ids are addresses): before any of it is followed."""
    if len(route) > later:
        raise InvalidArgument(f"a route of {len(route)} stages; {later} come after this one")
    for k, stage in enumerate(route):
        where = f"the route's stage {k}"
        if len(stage.peers) > MAX_ROUTE_MEMBERS:
            raise InvalidArgument(
                f"{where} names {len(stage.peers)} replicas (at most {MAX_ROUTE_MEMBERS})"
            )
        if len(stage.addresses) != len(stage.peers) or len(stage.throughput) > len(stage.peers):
            raise InvalidArgument(
                f"{where}: {len(stage.peers)} peers, {len(stage.addresses)} addresses and "
                f"{len(stage.throughput)} throughputs do not pair"
            )
        if not all(math.isfinite(t) and t >= 0 for t in stage.throughput):
            # the sender's word: an infinite one failed the wiring's add (a bug's INTERNAL)
            said = [t for t in stage.throughput if not (math.isfinite(t) and t >= 0)][:3]
            raise InvalidArgument(f"{where}: a throughput is no speed: {said}")
        for peer, address in zip(stage.peers, stage.addresses, strict=True):
            named = 0 < len(peer) <= MAX_ADDRESS_CHARS and peer.isprintable()
            if not named or not 0 < len(address) <= MAX_ADDRESS_CHARS or not address.isprintable():
                raise InvalidArgument(
                    f"{where} names no replica: peer {peer[:40]!r} at {address[:80]!r}"
                )


class ClientFactory(Protocol):
    """Makes the client of one replica: `StageClient` itself (unit tests give fakes); `direct`:
    a relayed address dialled past its relay (`swarm.rpc.lan`)."""

    def __call__(
        self,
        address: str,
        job: JobConfig,
        job_id: str,
        stage: int,
        token: str | None,
        /,
        *,
        direct: bool = False,
    ) -> StageClient: ...


def members_of(route: pb.Route) -> list[Replica]:
    """The replicas a push request's route names for one stage (a missing throughput: unknown)."""
    speeds = list(route.throughput)
    return [
        Replica(peer, address, speeds[i] if i < len(speeds) else 0.0)
        for i, (peer, address) in enumerate(zip(route.peers, route.addresses, strict=False))
    ]


class Routes:
    """A pool per stage (`wiring`) and a client per replica (`clients`), kept to the members;
    why their calls last failed (`causes`)."""

    def __init__(
        self,
        job: JobConfig,
        job_id: str,
        token: str | None,
        wiring: Wiring,
        client_factory: ClientFactory = StageClient,
        shortcuts: lan.Shortcuts = lan.SHORTCUTS,
    ) -> None:
        self.job, self.job_id, self.token, self.wiring = job, job_id, token, wiring
        self.causes = Causes()
        self.retiring = Retiring(job.runtime.rpc_timeout_s)
        self.shortcuts = shortcuts
        self._client_factory = client_factory
        # Made when a call first needs one: a route may name 1,024 (`route_clients`).
        self.clients = RouteClients(self._make, self._dialled_directly, self.retiring)

    def _make(self, path: Path, direct: bool) -> StageClient:
        return self._client_factory(
            path.address, self.job, self.job_id, path.stage, self.token, direct=direct
        )

    def _dialled_directly(self, address: str) -> bool:
        return self.shortcuts.direct(address, self.token)

    def follow(self, stage: int, members: Iterable[Replica]) -> None:
        """Make `stage`'s pool exactly `members`: one that left the stage leaves the pool and
        its client is retired; a new one enters at its announced throughput (unknown: 1.0, so
        it is tried soon); one whose address changed, or whose path did (a relayed peer found
        on this caller's LAN, or lost there: `swarm.rpc.lan`), gets a new client."""
        present = {r.peer: r for r in members}
        pool = self.wiring[stage]
        for gone in [p for p in pool if p not in present]:
            self.wiring.remove(gone)
            self.clients.drop(gone)
        for peer, r in present.items():
            self.clients.set(peer, Path(r.address, stage))
            if peer not in pool:
                self.wiring.add(peer, stage, known_speed(r.throughput) or 1.0)  # 0: unknown

    def lost(self, peer: str, client: StageClient | None = None) -> None:
        """A call to `peer` over `client` failed: if that client is its current one and dialled
        past its relay, that path is given up (`swarm.rpc.lan`) and the peer's next calls go
        through its relay. A call over a client retired since (closed early past the bound, or
        replaced by a direct one) says nothing of the path its current client takes."""
        path = self.clients.path(peer)
        if path is None or not self.clients.direct(peer):
            return
        if client is not None and client is not self.clients.current(peer):
            return
        self.shortcuts.lost(path.address)
        self.clients.retire(peer)

    def follow_all(self, replicas: Sequence[Sequence[Replica]]) -> set[str]:
        """Follow every stage's members at once (a coordinator's view); returns the peers that
        left every stage. A view of another number of stages (the job not started yet, whose
        lease names none) changes nothing."""
        if len(replicas) != self.wiring.num_stages:
            return set()
        present = {r.peer for members in replicas for r in members}
        departed = self.clients.members() - present
        for stage, members in enumerate(replicas):
            self.follow(stage, members)
        return departed

    async def close(self) -> None:
        await self.retiring.close()
        await self.clients.close()
