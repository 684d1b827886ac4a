"""The event loop's default thread pool, its threads named where the operating system shows
them (`/proc/PID/task/*/comm`, `top -H`), so that a pool growing to its bound is told from a
leak from outside the process.

Python (3.11) names its threads for itself only: from outside, every Python thread of a
process reads "python". The loop's default executor (`asyncio.to_thread`,
`run_in_executor(None, ...)`) adds a worker whenever a call finds none idle, up to its
`max_workers` (min(32, CPUs + 4)), and keeps it: a process's thread count follows the busiest
moment it has had so far, then stays. A stage server that is given work only late in a long run
(a second replica the wiring routed little to, until a chaos event moved its traffic) grows its
count then: bench/soak.py read that as a peer's threads growing 13 -> 17 and failed. Named
`POOL` at the OS, the soak judges the threads less the pools' own (as it judges descriptors
less live connections); every other thread still counts.

`entry` (swarm/cli.py) installs `NamedPools` for the process's loops: the `swarm` command's own
processes only, never a test's interpreter that calls `main` in-process."""

from __future__ import annotations

import asyncio
import ctypes
import logging
from concurrent.futures import ThreadPoolExecutor

__all__ = ["POOL", "NamedPools", "name_this_thread"]

log = logging.getLogger(__name__)

POOL = "asyncio-pool"
"""The OS name of the default executor's threads (at most 15 bytes: the kernel's limit)."""

_PR_SET_NAME = 15  # prctl(2): the calling thread's name


def name_this_thread(name: str) -> None:
    """Give the calling thread `name` at the OS (Linux; elsewhere, or refused, it keeps
    "python", which costs only the soak's judgment)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        failed = libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0) != 0
    except (OSError, AttributeError) as e:  # no libc prctl: not Linux
        log.debug("thread name %r not set: %s", name, e)
        return
    if failed:
        log.debug("thread name %r not set: errno %d", name, ctypes.get_errno())


class NamedPools(asyncio.DefaultEventLoopPolicy):
    """Every new event loop's default executor as asyncio makes it (the same `max_workers`,
    threads named "asyncio_N" in Python), its workers named `POOL` at the OS."""

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        loop = super().new_event_loop()
        pool = ThreadPoolExecutor(
            thread_name_prefix="asyncio", initializer=name_this_thread, initargs=(POOL,)
        )
        loop.set_default_executor(pool)
        return loop
