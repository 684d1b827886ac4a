"""The splice that carries a tunnel's bytes, off the event loop: once a relay (or a NAT'd peer)
has joined two connections, their sockets are taken from asyncio and two threads, one per
direction, copy between them. On Linux each copy is `os.splice` through a pipe (socket -> pipe
-> socket: the bytes never come up to Python, nor into user memory); elsewhere, or where the
kernel refuses it, a plain `recv_into` / `sendall` loop. Why threads: a relay under `--relay`
shares its process with a stage server, and a NAT'd peer's own splices share its gRPC server's
loop; bytes copied on that loop, a chunk per callback, took the loop's time from the calls they
carry (issue 51, item 8). A blocking copy in a thread gives the loop back and holds the GIL only
between system calls.

Bounds: a direction reads at most a pipe (or a `chunk`) ahead of the side it writes to, so a far
end that stops reading stops the copy, not the relay's memory. Each tunnel holds its two sockets,
two pipes (four descriptors) and two threads, as many as the tunnel caps allow
(`swarm.relay.limits` counts the descriptors). The end of either direction (an end of stream, a
reset, a killed process) shuts both sockets down, which wakes the other direction's blocked call:
no half-closed tunnel lingers (gRPC's HTTP/2 never half-closes a connection, and a side that did
could otherwise hold the tunnel's slot for ever)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

from swarm.deadline import within

__all__ = ["ZERO_COPY", "splice"]

ZERO_COPY = sys.platform == "linux" and hasattr(os, "splice")
"""Whether `os.splice` through a pipe is tried first (Linux)."""

_F_SETPIPE_SZ = 1031  # fcntl's F_SETPIPE_SZ (Linux); `fcntl` names it only from Python 3.10 on
_TAKE_S = 10.0  # for what was written before the splice (an answer, a head) to leave
Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]
Count = Callable[[int], None]


async def splice(
    a: Stream,
    b: Stream,
    chunk: int,
    count: Count = lambda n: None,
    *,
    zero_copy: bool | None = None,
) -> None:
    """Copy a<->b in two threads until either side ends or fails; then shut both down and close
    them. What each side's reader had read past its head goes first, and what was written to
    each before is sent before the splice begins. `chunk`: each read's bound (and a pipe's
    size); `count` hears each copy's bytes, from the copying threads. `zero_copy`: through a
    pipe with `os.splice`, else `recv_into` / `sendall` (None: `ZERO_COPY`, where it works)."""
    taken: list[tuple[socket.socket, bytes]] = []
    try:
        for stream in (a, b):
            taken.append(await _take(stream))
    except BaseException as e:  # gone meanwhile, or cancelled: nothing is left open
        for sock, _ in taken:
            sock.close()
        for stream in (a, b):
            stream[1].transport.abort()
        if isinstance(e, (ConnectionError, OSError, TimeoutError)):
            return
        raise
    (sa, left_a), (sb, left_b) = taken
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def finished() -> None:  # from the last thread to end
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
            loop.call_soon_threadsafe(_settle, done)

    tunnel = _Tunnel(sa, sb, chunk, count, finished, ZERO_COPY if zero_copy is None else zero_copy)
    tunnel.start(left_a, left_b)
    try:
        await done
    finally:
        tunnel.end()  # cancelled (the relay stops): the threads wake, end, and close the sockets


def _settle(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


async def _take(stream: Stream) -> tuple[socket.socket, bytes]:
    """`stream`'s socket, taken from asyncio (a descriptor of its own, blocking; the transport
    closed without shutting the connection down), and the bytes its reader had read past the
    head. The transport's unsent bytes are sent first."""
    reader, writer = stream
    transport: Any = writer.transport
    if transport.is_closing():
        raise ConnectionResetError("closed before the splice began")
    transport.pause_reading()  # nothing more into the reader's buffer
    transport.set_write_buffer_limits(high=0)
    await within(writer.drain(), _TAKE_S)  # drain() waits for an empty buffer now
    # The head was read through a StreamReader, which may hold bytes that followed it (only
    # its private buffer says so): they are passed on first.
    leftover = bytes(getattr(reader, "_buffer", b""))
    sock = socket.socket(fileno=os.dup(transport.get_extra_info("socket").fileno()))
    # abort() closes asyncio's descriptor only (no shutdown, nothing left to send): the
    # connection lives on in this one.
    transport.abort()
    sock.setblocking(True)
    return sock, leftover


class _Tunnel:
    """Two sockets and the two threads copying between them; the first direction to end shuts
    both down, the last closes them and calls `finished`."""

    def __init__(
        self,
        a: socket.socket,
        b: socket.socket,
        chunk: int,
        count: Count,
        finished: Callable[[], None],
        zero_copy: bool,
    ) -> None:
        self.a, self.b, self.chunk, self.count = a, b, chunk, count
        self.finished, self.zero_copy = finished, zero_copy
        self._lock = threading.Lock()
        self._ended = False
        self._running = 0

    def start(self, left_a: bytes, left_b: bytes) -> None:
        for src, dst, first in ((self.a, self.b, left_a), (self.b, self.a, left_b)):
            thread = threading.Thread(
                target=self._run, args=(src, dst, first), name="relay-splice", daemon=True
            )
            with self._lock:
                self._running += 1
            try:
                thread.start()
            except RuntimeError:  # no thread to be had: the tunnel ends
                self.end()
                self._left()

    def end(self) -> None:
        """Shut both sockets down (once): each blocked read returns, each blocked write fails."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
        for sock in (self.a, self.b):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _run(self, src: socket.socket, dst: socket.socket, first: bytes) -> None:
        try:
            if first:
                dst.sendall(first)
                self.count(len(first))
            if not (self.zero_copy and _spliced(src, dst, self.chunk, self.count)):
                _copied(src, dst, self.chunk, self.count)
        except OSError:
            pass  # reset, or shut down by the other direction: the tunnel ends either way
        finally:
            self.end()
            self._left()

    def _left(self) -> None:
        with self._lock:
            self._running -= 1
            last = self._running == 0
        if last:
            self.a.close()
            self.b.close()
            self.finished()


def _spliced(src: socket.socket, dst: socket.socket, chunk: int, count: Count) -> bool:
    """Copy src -> dst through a pipe with `os.splice` until src's end of stream: True; False
    when the kernel cannot splice these (nothing was copied: the plain copy takes over)."""
    try:
        read_end, write_end = os.pipe()
    except OSError as e:
        if e.errno in (errno.EMFILE, errno.ENFILE):
            return False  # no descriptors for a pipe: the plain copy needs none
        raise
    try:
        with contextlib.suppress(OSError):  # over the per-user pipe budget: the default size
            import fcntl

            fcntl.fcntl(write_end, _F_SETPIPE_SZ, chunk)
        moved = 0
        while True:
            try:
                n = os.splice(src.fileno(), write_end, chunk, flags=os.SPLICE_F_MOVE)
            except OSError as e:
                if moved == 0 and e.errno == errno.EINVAL:
                    return False  # not a socket the kernel splices
                raise
            if n == 0:
                return True
            moved += n
            left = n
            while left:
                left -= os.splice(read_end, dst.fileno(), left, flags=os.SPLICE_F_MOVE)
            count(n)
    finally:
        os.close(read_end)
        os.close(write_end)


def _copied(src: socket.socket, dst: socket.socket, chunk: int, count: Count) -> None:
    """Copy src -> dst through one buffer until src's end of stream."""
    buffer = memoryview(bytearray(chunk))
    while n := src.recv_into(buffer):
        dst.sendall(buffer[:n])
        count(n)
