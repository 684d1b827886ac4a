"""A swarm process's lifecycle, the same for every role: SIGTERM/SIGINT stop it gracefully (a
second signal exits at once), and once it serves it prints one ready line,
`swarm <role> ready: key=value ...`, that the demo, the benchmarks and the tests wait for."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
from collections.abc import Awaitable

__all__ = [
    "install_signal_handlers",
    "parse_ready",
    "print_ready",
    "ready_line",
    "unless_stopped",
]

log = logging.getLogger(__name__)
_READY = re.compile(r"swarm [\w-]+ ready: (.*)$")


def install_signal_handlers(stop: asyncio.Event) -> None:
    """SIGTERM/SIGINT set `stop`; a second one exits at once."""
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set():
            log.warning("second signal: exiting now")
            os._exit(1)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)


async def unless_stopped(wait: Awaitable[object], stop: asyncio.Event) -> bool:
    """`await wait`, cut short by `stop` (a SIGTERM in a process's first seconds stops it
    then): whether `wait` ended first (its error raised), False where `stop` came first."""
    waiting, stopping = asyncio.ensure_future(wait), asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({waiting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (waiting, stopping):
            task.cancel()
        await asyncio.gather(waiting, stopping, return_exceptions=True)
    if not waiting.done() or waiting.cancelled():
        return False
    waiting.result()  # its error, if it ended by one
    return True


def ready_line(role: str, **fields: object) -> str:
    return f"swarm {role} ready: " + " ".join(f"{k}={v}" for k, v in fields.items())


def print_ready(role: str, **fields: object) -> None:
    print(ready_line(role, **fields), flush=True)


def parse_ready(line: str) -> dict[str, str] | None:
    """The key=value pairs of a ready line, or None if `line` is not one."""
    match = _READY.search(line)
    if match is None:
        return None
    return dict(kv.split("=", 1) for kv in match.group(1).split() if "=" in kv)
