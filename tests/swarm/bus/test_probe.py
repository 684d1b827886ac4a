"""What a `--broker` port answers, read by `swarm.bus.probe` within its timeout in all: a listener
that trickles its answer a byte at a time holds the probe no longer than one that says nothing."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from swarm.bus.probe import not_a_broker


@pytest.fixture
def trickler() -> Iterator[int]:
    """A port whose listener answers any connection an HTTP/2 SETTINGS frame header, one byte
    every 0.4 s."""
    server = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            for b in bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]):
                if done.wait(0.4):
                    return
                conn.sendall(bytes([b]))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        done.set()
        server.close()
        thread.join(5)


def test_a_trickled_answer_is_waited_for_no_longer_than_the_timeout(trickler: int) -> None:
    began = time.monotonic()
    said = not_a_broker("127.0.0.1", trickler, None, timeout=1.0)
    took = time.monotonic() - began
    assert took < 1.5, f"the probe took {took:.1f} s for a 1 s timeout"  # 9 bytes: 3.6 s whole
    assert said is None or "not an MQTT broker" in said  # what came by then, read as it is
