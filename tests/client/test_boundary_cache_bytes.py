"""The boundary cache's byte count is what it holds: a stage of a microbatch run again (a
backward that failed, given back and leased again) replaces its bytes, it does not add to them.
Counted twice, the cache read as full with nothing in it, and every replay from it missed."""

from __future__ import annotations

import torch

from client.data_plane.boundary_cache import BoundaryCache
from swarm.wire.crossing import Crossing

ENTRY = 2 * 400  # a stage's crossing and its gradient: 100 float32s each


def test_a_stage_remembered_again_counts_its_bytes_once() -> None:
    cache = BoundaryCache(10 * ENTRY, delays=False)
    x = torch.zeros(100)
    for _ in range(3):  # the same stage of one microbatch, run three times
        cache.remember(5, 0, 1, Crossing(x), x)
    assert cache.nbytes == ENTRY
    cache.remember(6, 0, 1, Crossing(x), x)  # step 6: step 5's entry is forgotten
    assert len(cache) == 1 and cache.nbytes == ENTRY


def test_retries_over_many_steps_leave_room_for_the_next_microbatch() -> None:
    cache = BoundaryCache(10 * ENTRY, delays=False)
    x = torch.zeros(100)
    for step in range(40):
        for _ in range(2):  # each step's microbatch run once more
            cache.remember(step, 0, 1, Crossing(x), x)
    cache.remember(100, 1, 1, Crossing(x), x)
    assert cache.get(100, 1) is not None and cache.nbytes == ENTRY
