"""The default executor's threads named at the OS (`swarm.ops.threads`): what bench/soak.py
reads to tell the pool's growth to its bound from a leak."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from swarm.ops.threads import POOL, NamedPools


def _os_names() -> list[str]:
    return [p.read_text().strip() for p in Path("/proc/self/task").glob("*/comm")]


def test_a_loops_default_executor_names_its_threads_at_the_os() -> None:
    before = _os_names().count(POOL)
    started = threading.Barrier(3)

    async def busy() -> None:
        # three calls at once: three workers, each named as it starts
        await asyncio.gather(*(asyncio.to_thread(started.wait, 10.0) for _ in range(3)))
        assert _os_names().count(POOL) == before + 3

    loop = NamedPools().new_event_loop()
    try:
        loop.run_until_complete(busy())
    finally:
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()
