"""Free ports for tests: the OS picks one; a race with another process is possible but rare."""

from __future__ import annotations

import socket

__all__ = ["free_address", "free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def free_address(host: str = "127.0.0.1") -> str:
    """`host:port` with nothing listening on it a moment ago."""
    return f"{host}:{free_port(host)}"
