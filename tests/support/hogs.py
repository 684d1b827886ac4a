"""CPU hogs for tests that need a busy machine: processes that spin until told to stop. This
module imports the standard library only, so a spawned hog starts in milliseconds instead of
importing torch first (which is seconds of CPU of another kind, and would leave the machine
busy in a different way at the start of the test than at its end)."""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Iterator
from multiprocessing.synchronize import Event

__all__ = ["busy"]


def _spin(ready: Event, stop: Event) -> None:
    ready.set()
    while not stop.is_set():
        sum(range(10_000))


@contextlib.contextmanager
def busy(hogs: int) -> Iterator[None]:
    """`hogs` processes spinning for the length of the block: it starts once every one spins."""
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    procs = []
    try:
        for _ in range(hogs):
            ready = ctx.Event()
            proc = ctx.Process(target=_spin, args=(ready, stop), daemon=True)
            proc.start()
            procs.append(proc)
            if not ready.wait(timeout=60):
                raise RuntimeError("a CPU hog did not start")
        yield
    finally:
        stop.set()
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
