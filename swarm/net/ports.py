"""The ports a process listens on, and a port already taken told in one line: the port, the flag
that moves it and that flag's variable. `naming` checks each port a command was given before
its slow start (torch, gRPC), and names the flag again when the bind itself finds the port
taken (taken in between, or one port given to two flags); the bind sites raise `PortInUse`
for their `Listener`."""

from __future__ import annotations

import contextlib
import enum
import errno
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from swarm.errors import SwarmError
from swarm.net.addresses import host_port

__all__ = ["Listener", "PortFlag", "PortInUse", "bind_error", "naming", "raise_if_taken"]


class Listener(enum.Enum):
    """What a process listens for: one port each."""

    GRPC = "its gRPC service"
    METRICS = "its /metrics"
    BROKER = "its embedded MQTT broker"


class PortInUse(SwarmError):
    """Another process listens on the port `listener` was to listen on."""

    def __init__(self, host: str, port: int, listener: Listener) -> None:
        self.host, self.port, self.listener = host, port, listener
        super().__init__(
            f"port {port} is taken ({host_port(host, port)}, for {listener.value}): another "
            "process listens there"
        )


@dataclass(frozen=True)
class PortFlag:
    """The flag (and its variable) that gives `listener` its port."""

    listener: Listener
    flag: str  # "--metrics-port"
    env: str  # "SWARM_SCHEDULER_METRICS_PORT"

    def taken(self, error: PortInUse) -> SwarmError:
        return SwarmError(
            f"{error} (an earlier one still running?): give {self.flag} another port, or 0 for "
            f"any free one ({self.env})"
        )


def bind_error(host: str, port: int) -> OSError | None:
    """Why `host:port` cannot be listened on now (as asyncio and gRPC bind it, with
    SO_REUSEADDR); None when it can."""
    try:
        family, _, _, _, address = socket.getaddrinfo(
            host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except OSError as e:
        return e
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as e:
            return e
    return None


def raise_if_taken(error: BaseException | None, host: str, port: int, listener: Listener) -> None:
    """`PortInUse` when `error` (a failed bind's) says the port is taken."""
    if isinstance(error, OSError) and error.errno == errno.EADDRINUSE:
        raise PortInUse(host, port, listener) from None


@contextlib.contextmanager
def naming(host: str, ports: Sequence[tuple[PortFlag, int | None]]) -> Iterator[None]:
    """Refuse at once a port given (not None, not 0) that another process listens on, and
    inside, turn a `PortInUse` into the message that names its flag."""
    for flag, port in ports:
        if port:
            try:
                raise_if_taken(bind_error(host, port), host, port, flag.listener)
            except PortInUse as e:
                raise flag.taken(e) from None
    try:
        yield
    except PortInUse as e:
        given = [flag for flag, _ in ports if flag.listener is e.listener]
        if not given:
            raise
        raise given[0].taken(e) from None
