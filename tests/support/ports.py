"""Free ports for tests: a port a test hands to a process it starts, free a moment ago.

Not one the kernel picks (port 0): those come from its ephemeral range, which it also hands to
every socket bound to port 0 and to every outgoing connection's end, the other xdist worker's
included, so one could be taken between the test's look and the process's bind (CI: "Address
already in use", tests/test_free_ports.py). A free port comes from below that range, from the
part of it that is this xdist worker's alone (`worker_ports`), checked free by a bind."""

from __future__ import annotations

import contextlib
import os
import random
import socket
from collections.abc import Iterator
from pathlib import Path

__all__ = ["free_address", "free_port", "taken_port", "worker_ports"]

LOWEST = 10_000  # below: the well-known and registered ports services and tests name
WORKERS = 8  # the parts the span is cut into: xdist workers 0-7 (more share them, modulo)
TRIES = 200


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def worker_ports() -> range:
    """The ports this xdist worker's tests take theirs from (gwN: the Nth part; not under
    xdist: the first)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    size = (_ephemeral_start() - LOWEST) // WORKERS
    low = LOWEST + (index % WORKERS) * size
    return range(low, low + size)


def free_port(host: str = "127.0.0.1") -> int:
    """A port of this worker's (`worker_ports`) that was free a moment ago (bound, then
    released); a random one, so a port an earlier test's process may still hold is rarely
    tried first (one that is held fails the bind, and another is tried)."""
    span = worker_ports()
    for _ in range(TRIES):
        port = random.choice(span)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {span.start}-{span.stop - 1} after {TRIES} tries")


def free_address(host: str = "127.0.0.1") -> str:
    """`host:port` with nothing listening on it a moment ago."""
    return f"{host}:{free_port(host)}"


@contextlib.contextmanager
def taken_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A port another socket listens on for the block: a port in use."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        sock.listen()
        yield int(sock.getsockname()[1])
