"""The carry plane's boundary cache replays nothing of a run from before a rollback
(`swarm.rpc.epoch`): its bytes of the same `(step, index)` may rest on a banned peer's answers
further up the pipeline than the producers it keeps name."""

from __future__ import annotations

import asyncio

import torch

from client.data_plane.boundary_cache import BoundaryCache
from swarm.rpc import epoch
from swarm.rpc.stage_client import WireCrossing
from swarm.wire.crossing import Crossing


def test_bytes_remembered_before_a_rollback_are_not_replayed_after_it() -> None:
    async def run() -> None:
        cache = BoundaryCache(1 << 20, delays=False)
        x: WireCrossing = Crossing(torch.ones(2))
        g = torch.zeros(2)
        epoch.leased_in(5)
        cache.remember(0, 3, 1, x, g, ["a"])
        assert cache.get(0, 3) == {1: (x, g)}
        epoch.leased_in(6)  # a replay of (0, 3) leased after a rollback
        assert cache.get(0, 3) is None
        cache.remember(0, 3, 2, x, g, ["b"])  # this epoch's run: the old bytes are gone
        assert cache.get(0, 3) == {2: (x, g)} and cache.producers(0, 3, [1, 2]) == {"b"}

    asyncio.run(run())  # its own context: the epoch set here stays here
