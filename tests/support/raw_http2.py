"""Just enough HTTP/2 over a plain socket to be the stranger a gRPC library would never be: the
connection preface, SETTINGS, a HEADERS frame with a hand-encoded HPACK block (literal fields,
no Huffman, no table), and a DATA frame holding part of a gRPC message, with no END_STREAM.

`RawHttp2` opens one connection; a reader thread acknowledges the server's SETTINGS and PINGs
(as a real client must, or the server drops the connection), follows the flow-control windows
the server grants, and notes, per stream, whether the server closed it (trailers with
END_STREAM, or RST_STREAM).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Sequence

__all__ = ["PREFACE", "RawHttp2", "grpc_message_prefix", "hpack_literals"]

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
_INITIAL_WINDOW_SIZE = 0x4  # the SETTINGS parameter
_DEFAULT_WINDOW = 65_535
_MAX_FRAME = 16_384  # the smallest maximum frame size: every peer takes it


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame (RFC 9113 §4.1)."""
    head = struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream)
    return head + payload


def _integer(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """An HPACK integer (RFC 7541 §5.1) in a `prefix_bits` prefix; `first` holds the bits above."""
    top = (1 << prefix_bits) - 1
    if value < top:
        return bytes([first | value])
    out, value = [first | top], value - top
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    return bytes([*out, value])


def _string(text: str) -> bytes:
    raw = text.encode("latin-1")
    return _integer(len(raw), 7) + raw  # H = 0: no Huffman


def hpack_literals(fields: Sequence[tuple[str, str]]) -> bytes:
    """A header block of literal fields without indexing, each with a new name (RFC 7541
    §6.2.2): any decoder reads it, and it leaves the decoder's table as it was."""
    return b"".join(b"\x00" + _string(name) + _string(value) for name, value in fields)


def grpc_message_prefix(declared: int) -> bytes:
    """A gRPC message's five-byte prefix: not compressed, `declared` bytes to follow."""
    return b"\x00" + struct.pack(">I", declared)


class RawHttp2:
    """One HTTP/2 connection to `host`:`port`, spoken by hand."""

    def __init__(self, host: str, port: int, *, timeout_s: float = 10.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._authority = f"{host}:{port}"
        self._lock = threading.Lock()
        self._windows = threading.Condition()  # guards the flow-control windows below
        self._connection_window = _DEFAULT_WINDOW
        self._initial_window = _DEFAULT_WINDOW  # a new stream's, as the server's SETTINGS say
        self._stream_windows: dict[int, int] = {}
        self.closed_streams: set[int] = set()  # streams the server ended or reset
        self.goaway = False
        self.eof = threading.Event()  # the server closed the connection
        self.settings = threading.Event()  # the server's SETTINGS came: it took the connection
        self._next_stream = 1

    def preface(self) -> None:
        """The client's preface and an empty SETTINGS; starts the reader."""
        self.send(PREFACE + frame(SETTINGS, 0, 0))
        threading.Thread(target=self._read, daemon=True, name="raw-http2").start()

    def send(self, data: bytes) -> None:
        with self._lock:
            self.sock.sendall(data)

    def half_sent_call(
        self,
        path: str,
        *,
        declared: int,
        body: bytes = b"",
        metadata: Sequence[tuple[str, str]] = (),
    ) -> int:
        """Open a gRPC call to `path` and send the first `len(body)` bytes of a message that
        declares `declared` bytes, without ending the stream; its stream id."""
        stream, self._next_stream = self._next_stream, self._next_stream + 2
        with self._windows:
            self._stream_windows[stream] = self._initial_window
        fields = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", self._authority),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            *metadata,
        ]
        self.send(frame(HEADERS, END_HEADERS, stream, hpack_literals(fields)))
        self.send_body(stream, grpc_message_prefix(declared) + body, timeout_s=5.0)
        return stream

    def send_body(self, stream: int, data: bytes, *, timeout_s: float) -> int:
        """Send `data` on `stream` (no END_STREAM) as fast as the server's flow-control windows
        allow, until it is all sent, the server closes the stream or the connection, or
        `timeout_s` passes; how many bytes were sent."""
        deadline = time.monotonic() + timeout_s
        sent = 0
        while sent < len(data):
            with self._windows:
                while (room := self._room(stream)) <= 0:
                    left = deadline - time.monotonic()
                    if stream in self.closed_streams or self.eof.is_set() or left <= 0:
                        return sent
                    self._windows.wait(min(left, 0.1))
                n = min(room, _MAX_FRAME, len(data) - sent)
                self._connection_window -= n
                self._stream_windows[stream] -= n
            try:
                self.send(frame(DATA, 0, stream, data[sent : sent + n]))
            except OSError:
                return sent
            sent += n
        return sent

    def _room(self, stream: int) -> int:
        if stream in self.closed_streams:
            return 0
        return min(self._connection_window, self._stream_windows.get(stream, 0))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def _read(self) -> None:
        buffer = b""
        try:
            while True:
                chunk = self.sock.recv(1 << 16)
                if not chunk:
                    break
                buffer += chunk
                while len(buffer) >= 9:
                    length = int.from_bytes(buffer[:3], "big")
                    if len(buffer) < 9 + length:
                        break
                    kind, flags = buffer[3], buffer[4]
                    stream = int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF
                    payload, buffer = buffer[9 : 9 + length], buffer[9 + length :]
                    self._on_frame(kind, flags, stream, payload)
        except OSError:
            pass
        finally:
            self.eof.set()
            with self._windows:
                self._windows.notify_all()

    def _on_frame(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        if kind == SETTINGS and not flags & ACK:
            self._on_settings(payload)
            self.send(frame(SETTINGS, ACK, 0))
            self.settings.set()
        elif kind == WINDOW_UPDATE:
            increment = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
            with self._windows:
                if stream == 0:
                    self._connection_window += increment
                elif stream in self._stream_windows:
                    self._stream_windows[stream] += increment
                self._windows.notify_all()
        elif kind == PING and not flags & ACK:
            self.send(frame(PING, ACK, 0, payload))
        elif kind == GOAWAY:
            self.goaway = True
        elif kind == RST_STREAM or (kind in (HEADERS, DATA) and flags & END_STREAM):
            with self._windows:
                self.closed_streams.add(stream)
                self._windows.notify_all()

    def _on_settings(self, payload: bytes) -> None:
        for at in range(0, len(payload) - 5, 6):
            key, value = struct.unpack(">HI", payload[at : at + 6])
            if key == _INITIAL_WINDOW_SIZE:  # applies to open streams too (RFC 9113 §6.9.2)
                with self._windows:
                    for stream in self._stream_windows:
                        self._stream_windows[stream] += value - self._initial_window
                    self._initial_window = value
                    self._windows.notify_all()
