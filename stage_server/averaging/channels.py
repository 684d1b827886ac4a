"""The channels a replica dials its pool's peers over (`PoolService`): one per peer address,
reused across rounds, the idle ones closed."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any, cast

import grpc

from stage_server.peer.links import LinkMeter, TimedCall
from swarm.clock import Clock, MonotonicClock
from swarm.net import dial
from swarm.proto import pool_pb2_grpc

__all__ = ["ChannelPool"]

log = logging.getLogger(__name__)


class ChannelPool:
    """One `grpc.aio` channel per peer address, reused across rounds (a channel reconnects by
    itself); `discard` drops a peer that left, `close` all of them.

    A channel not asked for in `idle_s` (a peer no longer in any of this replica's groups: it left,
    or moved to another stage) is closed the next time any channel is asked for, so the pool over
    days of churn holds about the peers of the recent groups only. `idle_s` must outlast any call
    (the averaging and download deadlines): a call is made right after its channel is asked for.
    """

    def __init__(
        self,
        *,
        token: str | None = None,
        options: Sequence[tuple[str, Any]] | None = None,
        idle_s: float = 600.0,
        clock: Clock | None = None,
        link: LinkMeter | None = None,
    ) -> None:
        """`link`: where its calls record their bytes (`stage_server.peer.links`); None: nowhere."""
        self._token, self._options, self._link = token, options, link
        self._idle_s, self._clock = idle_s, clock or MonotonicClock()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._used: dict[str, float] = {}  # address -> when its channel was last asked for
        self._closing: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._channels)

    def channel(self, address: str) -> grpc.aio.Channel:
        now = self._clock.now()
        self._used[address] = now
        self._expire(now)
        if address not in self._channels:
            self._channels[address] = dial.channel(
                address, token=self._token, options=self._options
            )
        return self._channels[address]

    def stub(self, address: str) -> pool_pb2_grpc.PoolServiceStub:
        stub = pool_pb2_grpc.PoolServiceStub(self.channel(address))
        return stub if self._link is None else cast(Any, _Timed(stub, self._link))

    def _expire(self, now: float) -> None:
        for address in [a for a, t in self._used.items() if now - t > self._idle_s]:
            del self._used[address]
            channel = self._channels.pop(address, None)
            if channel is not None:
                log.debug("pool: closing the idle channel to %s", address)
                task = asyncio.get_running_loop().create_task(channel.close())
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)

    async def discard(self, address: str) -> None:
        self._used.pop(address, None)
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        channels, self._channels, self._used = list(self._channels.values()), {}, {}
        for channel in channels:
            await channel.close()
        await asyncio.gather(*self._closing, return_exceptions=True)


class _Timed:
    """A pool stub whose calls record their bytes in a link meter (`TimedCall`)."""

    def __init__(self, stub: pool_pb2_grpc.PoolServiceStub, link: LinkMeter) -> None:
        self._stub, self._link = stub, link

    def Reduce(self, **kwargs: Any) -> TimedCall:  # the stub's name
        return TimedCall(self._stub.Reduce(**kwargs), self._link)
