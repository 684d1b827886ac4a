"""Free ports for tests: the OS picks one; a race with another process is possible but rare."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

__all__ = ["free_address", "free_port", "taken_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


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
