"""A tunnel's bytes are copied off the event loop (issue 51, item 8: `swarm.relay.copier`), by
`os.splice` through a pipe and by the plain copy alike: a relay and a NAT'd peer sharing one
loop carry a stream while that loop is blocked, which a copy on the loop could not. And the end of
either side ends the whole tunnel: a peer's server that half-closes, a caller that dies."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import socket
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from swarm.net.paths import relay_credential
from swarm.relay import copier
from tests.support.relays import NAT_HOST, Relayed, relayed
from tests.support.waiting import wait_until

TOKEN = "relay-copy-token"
PART = 64 * 1024
PARTS = 32  # 2 MiB each way: more than the sockets and pipes of both splices hold
pytestmark = pytest.mark.timeout(120)


@dataclass
class _Echo:
    """The NAT'd peer's own server: plain blocking sockets in a thread of its own."""

    port: int
    ended: threading.Event = field(default_factory=threading.Event)


@contextlib.contextmanager
def _echo(half_close_after: int | None = None) -> Iterator[_Echo]:
    """Echoes one connection; after `half_close_after` bytes it shuts its sending side down
    (a half-close) and reads on. `ended`: its connection's far end closed."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(60)  # accept() is not woken by close() from another thread
    echo = _Echo(server.getsockname()[1])

    def serve() -> None:
        with contextlib.suppress(OSError):
            conn, _ = server.accept()
            with conn:
                echoed = 0
                with contextlib.suppress(OSError):
                    while data := conn.recv(PART):
                        if half_close_after is None or echoed < half_close_after:
                            conn.sendall(data)
                            echoed += len(data)
                            if half_close_after is not None and echoed >= half_close_after:
                                conn.shutdown(socket.SHUT_WR)
                echo.ended.set()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield echo
    finally:
        server.close()


def _connect(r: Relayed, port: int) -> socket.socket:
    """A caller's CONNECT through `r`'s relay to its peer, blocking; the tunnel's socket."""
    host, relay_port = r.relay_address.rsplit(":", 1)
    sock = socket.create_connection((host, int(relay_port)), timeout=20)
    login = base64.b64encode(f"{r.peer}:{relay_credential(TOKEN, r.peer)}".encode()).decode()
    sock.sendall(
        f"CONNECT {NAT_HOST}:{port} HTTP/1.1\r\nProxy-Authorization: Basic {login}\r\n\r\n".encode()
    )
    answer = b""
    while not answer.endswith(b"\r\n\r\n"):
        got = sock.recv(1)
        assert got, f"the relay closed the tunnel: {answer!r}"
        answer += got
    assert answer.startswith(b"HTTP/1.1 200"), answer
    return sock


def _exchange(sock: socket.socket) -> None:
    """`PARTS` parts sent and each one's echo read back, blocking: run on the loop's thread, it
    blocks the loop that the relay and the peer's attachment serve on."""
    for _ in range(PARTS):
        part = os.urandom(PART)
        sock.sendall(part)
        back = bytearray()
        while len(back) < PART:
            got = sock.recv(PART - len(back))  # a socket timeout (20 s) if the copy is stuck
            assert got, "the tunnel closed mid-stream"
            back += got
        assert back == part


def _splicing() -> int:
    return sum(t.name == "relay-splice" and t.is_alive() for t in threading.enumerate())


@pytest.mark.parametrize("zero_copy", [True, False], ids=["os.splice", "recv_into"])
async def test_a_tunnel_carries_its_stream_while_the_loop_is_blocked(
    zero_copy: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if zero_copy and not copier.ZERO_COPY:
        pytest.skip("os.splice is Linux's")
    monkeypatch.setattr(copier, "ZERO_COPY", zero_copy)
    with _echo() as echo:
        async with relayed(TOKEN, echo.port) as r:
            await wait_until(lambda: r.attachment.relay is not None, "the peer attached")
            sock = await asyncio.to_thread(_connect, r, echo.port)
            # The relay's splice and the peer's: two copying threads each, once joined.
            await wait_until(lambda: _splicing() == 4, lambda: f"{_splicing()} copying threads")
            with sock:
                _exchange(sock)  # the loop blocked throughout: nothing on it copies
            carried = "swarm_relay_bytes_total"
            await wait_until(
                lambda: (r.registry.get_sample_value(carried) or 0) >= 2 * PARTS * PART,
                "the relay counted both directions' bytes",
            )
            await wait_until(lambda: r.relay.tunnels == 0, "the relay's tunnel ended")
            await wait_until(echo.ended.is_set, "the peer's server saw its connection end")
    await wait_until(lambda: _splicing() == 0, lambda: f"{_splicing()} copying threads left")


@pytest.mark.parametrize("end", ["the peer's server half-closes", "the caller dies"])
async def test_either_side_ending_tears_the_whole_tunnel_down(end: str) -> None:
    """Before the copy threads, the same held; now a blocked copy must be woken to end."""
    half_close = end == "the peer's server half-closes"
    with _echo(half_close_after=PART if half_close else None) as echo:
        async with relayed(TOKEN, echo.port) as r:
            await wait_until(lambda: r.attachment.relay is not None, "the peer attached")
            sock = await asyncio.to_thread(_connect, r, echo.port)
            await wait_until(lambda: _splicing() == 4, lambda: f"{_splicing()} copying threads")
            with sock:
                await asyncio.to_thread(sock.sendall, b"x" * PART)
                if half_close:
                    # The echo comes back, then the end of the stream: the tunnel was closed
                    # although the peer's server still reads.
                    got = await asyncio.to_thread(_read_to_end, sock)
                    assert got == b"x" * PART
                else:  # killed: a reset, as a process's death with unread bytes sends
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            await wait_until(lambda: r.relay.tunnels == 0, "the relay's tunnel ended")
            await wait_until(lambda: not r.attachment._tunnels, "the peer's splice ended")
            await wait_until(echo.ended.is_set, "the peer's server saw its connection end")
            await wait_until(lambda: _splicing() == 0, lambda: f"{_splicing()} copying threads")


def _read_to_end(sock: socket.socket) -> bytes:
    got = b""
    while data := sock.recv(PART):
        got += data
    return got
