"""The client of each replica a sender's routes name, made when a call first needs it.

A replica on the push plane follows the route each request carries for the stage after its own:
up to `MAX_ROUTE_MEMBERS` replicas, named by whoever sent the request (any holder of the swarm's
token with a lease). Making a client for each, as the route was followed, cost about 90 ms of the
event loop for a route of 1,024 here and 17 KB each, and each replaced route's clients were kept
for the calls' deadline (`Retiring`): a token holder sending such routes, each naming others,
grew the receiver by 17 MB a request for a minute. Now a member is its path (address, stage)
until a call needs its client, which is when whether to dial it past its relay is asked; only a
client that was made is retired, and the retired are bounded too (`Retiring.most`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, KeysView
from dataclasses import dataclass

from swarm.errors import PeerUnavailable
from swarm.rpc.stage_client import StageClient

__all__ = ["MAX_RETIRING", "Path", "Retiring", "RouteClients"]

#: The most replaced clients kept open for their calls' deadline: past it the oldest is closed at
#: once (its calls in flight fail, and their hops try another replica). 17 MB of clients.
MAX_RETIRING = 1024


@dataclass(frozen=True)
class Path:
    """Where a member is called: its address and the stage it serves. A client is made for one
    path and one way of dialling it (past its relay or through it: `swarm.rpc.lan`)."""

    address: str
    stage: int


@dataclass(frozen=True)
class _Made:
    client: StageClient
    direct: bool  # dialled past its relay


class Retiring:
    """Stage clients that were replaced (their peer left, moved or came back at another address):
    each is closed once the calls it may still carry have had their deadline, `grace_s`; past
    `most` of them, the oldest at once."""

    def __init__(self, grace_s: float, most: int = MAX_RETIRING) -> None:
        self.grace_s, self.most = grace_s, most
        self._closing: dict[asyncio.Task[None], StageClient] = {}  # oldest first
        self._now: set[asyncio.Task[None]] = set()  # those closed early, until they are

    def retire(self, client: StageClient | None) -> None:
        if client is None:
            return

        async def close() -> None:
            await asyncio.sleep(self.grace_s)
            await client.close()

        task = asyncio.get_running_loop().create_task(close())
        self._closing[task] = client
        task.add_done_callback(lambda t: self._closing.pop(t, None))
        while len(self._closing) > self.most:
            oldest, old = next(iter(self._closing.items()))
            del self._closing[oldest]
            oldest.cancel()
            now = asyncio.get_running_loop().create_task(old.close())
            self._now.add(now)
            now.add_done_callback(self._now.discard)

    def __len__(self) -> int:
        """How many are still waiting to be closed."""
        return len(self._closing)

    async def close(self) -> None:
        """Close every retiring client now (their owner is closing)."""
        closing, self._closing = self._closing, {}
        for task in closing:
            task.cancel()
        await asyncio.gather(
            *(c.close() for c in closing.values()), *self._now, return_exceptions=True
        )


class RouteClients:
    """Peer -> its client, over the members a sender's routes follow: iterating, `members`, `len`
    and `in` read the members; `[peer]` and `get` make the member's client if it has none yet.
    Whether a member is dialled past its relay is asked (`direct`: `lan.Shortcuts.direct`, which
    starts a probe of a neighbour's LAN address) only of a member a call needs: a route of 1,024
    relayed neighbours' ids probed 1,024 addresses of the sender's choosing before.

    Not a `Mapping`, nor anything `dict()` reads as one: its `items`, `values` and `==`, or a
    `dict(clients)`, would make a client for every member, the cost this class exists to avoid;
    `made` is what has one."""

    def __init__(
        self,
        make: Callable[[Path, bool], StageClient],
        direct: Callable[[str], bool],
        retiring: Retiring,
    ) -> None:
        self._make, self._direct, self._retiring = make, direct, retiring
        self._paths: dict[str, Path] = {}
        self._made: dict[str, _Made] = {}

    def __getitem__(self, peer: str) -> StageClient:
        made = self._made.get(peer)
        if made is None:
            path = self._paths[peer]  # KeyError: no member
            direct = self._direct(path.address)
            try:
                client = self._make(path, direct)
            except ValueError as e:  # an address no client can dial (a route's, any sender's)
                raise PeerUnavailable(f"{peer} at {path.address[:80]!r}: {e}") from e
            made = self._made[peer] = _Made(client, direct)
        return made.client

    def get(self, peer: str) -> StageClient | None:
        """`self[peer]`, or None where `peer` is no member."""
        return self[peer] if peer in self._paths else None

    def members(self) -> KeysView[str]:
        """The members (no `keys`: with `[peer]` it would make `dict(clients)` and `{**clients}`
        read this as a mapping, a client made for every member)."""
        return self._paths.keys()

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)

    def __contains__(self, peer: object) -> bool:
        return peer in self._paths

    def path(self, peer: str) -> Path | None:
        return self._paths.get(peer)

    def made(self) -> dict[str, StageClient]:
        """The clients made so far (a call chose their member)."""
        return {peer: made.client for peer, made in self._made.items()}

    def current(self, peer: str) -> StageClient | None:
        """`peer`'s client if one was made (none is made here)."""
        made = self._made.get(peer)
        return None if made is None else made.client

    def direct(self, peer: str) -> bool:
        """Whether `peer`'s client, if made, dials it past its relay."""
        made = self._made.get(peer)
        return made is not None and made.direct

    def set(self, peer: str, path: Path) -> None:
        """`peer` is called at `path` now: a client made for another path, or dialled another
        way than its address now is, is retired (the next call makes another)."""
        made = self._made.get(peer)
        if made is not None and (
            self._paths.get(peer) != path or self._direct(path.address) != made.direct
        ):
            self.retire(peer)
        self._paths[peer] = path

    def retire(self, peer: str) -> None:
        """`peer`'s client, if made, is retired: its next call makes another."""
        made = self._made.pop(peer, None)
        self._retiring.retire(None if made is None else made.client)

    def drop(self, peer: str) -> None:
        """`peer` is no member now: its client, if made, is retired."""
        self._paths.pop(peer, None)
        self.retire(peer)

    async def close(self) -> None:
        made, self._made = self._made, {}
        self._paths.clear()
        await asyncio.gather(*(m.client.close() for m in made.values()))
