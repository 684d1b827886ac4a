"""One peer's own link to the broker, for system tests: a TCP forwarder on loopback that the test
can cut (every connection through it closed, new ones closed as they come) and mend again. A peer
given its `url` as broker is then cut off from the bus while its gRPC servers, and the other
peers' links, are untouched: the peer is alive, the broker only loses sight of it (its last-will
fires) until the link is mended and its bus reconnects by itself."""

from __future__ import annotations

import contextlib
import socket
import threading

__all__ = ["BrokerLink"]

HOST = "127.0.0.1"


class BrokerLink:
    """Forwards `HOST:port` (its own, free) to the broker at `HOST:broker_port` while not cut."""

    def __init__(self, broker_port: int) -> None:
        self.broker_port = broker_port
        self._listener = socket.create_server((HOST, 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._cut = False
        self._closed = False
        threading.Thread(target=self._accept, name="broker-link", daemon=True).start()

    @property
    def url(self) -> str:
        return f"mqtt://{HOST}:{self.port}"

    def cut(self) -> None:
        """Close every connection through the link; new ones are closed as they arrive."""
        with self._lock:
            self._cut = True
            for s in self._open:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            self._open.clear()

    def mend(self) -> None:
        """New connections are forwarded again."""
        with self._lock:
            self._cut = False

    def close(self) -> None:
        self.cut()
        self._closed = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                cut = self._cut
            if cut:
                client.close()
                continue
            try:
                upstream = socket.create_connection((HOST, self.broker_port), timeout=5)
            except OSError:  # the broker is down: the peer sees its connection refused
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._open |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        """Copy `source` to `sink` until either closes; then close both."""
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
            with self._lock:
                self._open -= {source, sink}
