"""The microbatches a step's ledger may lease (`scheduler.coordinator.ledger`): needed at some
stage, and under no live lease. Kept as leases are taken, given back, reported and expire, so
that a lease call costs the tasks it gives, not a scan of the step; given lowest first, so a
step's microbatches are run in order and a replay goes out before new work."""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterable, Iterator

__all__ = ["FreeTasks"]


class FreeTasks:
    def __init__(self, indices: Iterable[int]) -> None:
        self._free = set(indices)
        # `_free` as a min-heap, to give the lowest without a scan: an index leaves the set at
        # once and the heap when it comes up (stale entries skipped)
        self._heap = sorted(self._free)

    def __contains__(self, index: int) -> bool:
        return index in self._free

    def __len__(self) -> int:
        return len(self._free)

    def __iter__(self) -> Iterator[int]:
        return iter(self._free)

    def add(self, index: int) -> None:
        if index not in self._free:
            self._free.add(index)
            heapq.heappush(self._heap, index)

    def discard(self, index: int) -> None:
        self._free.discard(index)

    def lowest(self, count: int, exclude: Collection[int]) -> list[int]:
        """Up to `count` of the lowest free indices not in `exclude` (they stay free)."""
        heap, taken, skipped, seen = self._heap, list[int](), list[int](), set[int]()
        while heap and len(taken) < count:
            index = heapq.heappop(heap)
            if index not in self._free or index in seen:
                continue  # stale, or a duplicate entry
            seen.add(index)
            (skipped if index in exclude else taken).append(index)
        for index in taken + skipped:  # still free until the caller holds them
            heapq.heappush(heap, index)
        if len(heap) > 2 * len(self._free) + 64:  # mostly stale: rebuild
            self._heap = sorted(self._free)
        return taken
