"""The HTTP endpoint a process serves its `/metrics` (and the scheduler its `/sd`) on: an asyncio
server on a thread of its own, so a scrape never waits on the process's busy event loop.

It answers what it must and no more, to anyone who can reach the port:

- with a token, a request without `Authorization: Bearer <token>` gets 401 (the token compared
  as a digest, in constant time), whatever its path;
- with a TLS context, it speaks HTTPS only (the context says whether a client certificate is
  required);
- its cost is bounded whatever clients do: one thread; at most `Limits.connections` open at
  once; each has `request_s` to finish its TLS handshake and send its request, and `answer_s`
  to take the answer;
- when full, a new connection drops one of the host that holds the most (the new one's own host
  on a tie): its oldest that has sent nothing yet, else its oldest whose request is unfinished
  and holds no valid token, else its oldest still waiting for a request: a host that floods or
  churns connections, whatever its rate, only ever drops its own, and a scrape from another host
  (Prometheus) is never cut off, neither before its answer nor while taking it; nor one from the
  flood's own host once its token came (a scrape sends its request at once), however many
  silent or unfinished requests (slowloris) come after it. On Linux the kernel hands a
  connection over once its first bytes came, or silent after a second (`TCP_DEFER_ACCEPT`):
  a scrape is not taken for silent, and a flood's silent connections wait in the kernel's
  queue of half-open ones (`_BACKLOG`; past it, with SYN cookies, they are handed over at once
  and go first, as silent). The token is checked as its header line arrives (`_Heard`), not
  when the request ends, and among the bytes still waiting in the kernel of a connection about
  to be dropped (a peek; under TLS they are ciphertext, so any may hold it): a request that
  trickles its headers and never ends is told from a scrape only by it;
- a refused request (no token, the wrong one, not HTTP) is counted (`refused`) and logged rated
  (`swarm.ops.rated.RatedLog`: a line per reason every `_LOG_EVERY_S`), never a line per request.

HTTP/1.1 GET, one request per connection (`Connection: close`): what Prometheus needs.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import hmac
import http
import logging
import socket
import ssl
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import SupportsIndex

from swarm.ops.rated import RatedLog

__all__ = ["Answer", "Endpoint", "Handler", "Limits"]

log = logging.getLogger(__name__)
_LOG_EVERY_S = 10.0  # one line per refusal reason this often
# The listener's queues: connections not yet handed over, and (with TCP_DEFER_ACCEPT) those
# waiting for their first bytes (the kernel caps it at net.core.somaxconn)
_BACKLOG = 1024


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()


# (path, request headers with lower-case names) -> the answer; runs on the endpoint's thread
Handler = Callable[[str, Mapping[str, str]], Answer]


@dataclass(frozen=True)
class Limits:
    connections: int = 64  # open at once; a new one drops the oldest
    request_s: float = 10.0  # to finish the TLS handshake and send the request (seconds)
    answer_s: float = 10.0  # to take the answer (seconds)
    head_bytes: int = 16 * 1024  # the request line and headers

    def __post_init__(self) -> None:
        if self.connections < 1 or self.head_bytes < 1024:
            raise ValueError(f"{self}: needs connections >= 1 and head_bytes >= 1024")
        if not (self.request_s > 0 and self.answer_s > 0):
            raise ValueError(f"{self}: the timeouts must be positive")


class Endpoint:
    """Serves `handler` on a port once `start`ed; daemon: it lives as long as the process."""

    def __init__(
        self,
        handler: Handler,
        *,
        token: str | None = None,
        context: ssl.SSLContext | None = None,
        limits: Limits = Limits(),
    ) -> None:
        if token is not None and not token:
            raise ValueError("an empty token would let every scrape in; pass None for none")
        self._handler = handler
        self._expected = hashlib.sha256(token.encode()).digest() if token else None
        self._context = context
        self._limits = limits
        self._open: dict[asyncio.StreamWriter, tuple[str, _Heard]] = {}  # host, oldest first
        self._answering: set[asyncio.StreamWriter] = set()  # their request read
        self._log = RatedLog(log, _LOG_EVERY_S)
        self.refused = 0  # requests refused (401, 400), on the endpoint's thread

    def start(self, host: str, port: int) -> int:
        """Listen on `host`:`port` (bind errors raise here); the bound port."""
        family, _, _, _, address = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if hasattr(socket, "TCP_DEFER_ACCEPT"):  # Linux's; elsewhere taken at the handshake
                # The kernel hands a connection over once its first bytes came, or silent
                # after a second (its least): accepted before them, a scrape looked silent,
                # the first to go under its own host's flood. A second is ample for a client
                # that sends its request at once, and short, as deferred connections wait in
                # the listener's queue of half-open ones (`_BACKLOG`; past it, with SYN
                # cookies, Linux's default, they are handed over at once, silent).
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, 1)
            sock.bind(address)
        except BaseException:
            sock.close()
            raise
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True, name="metrics").start()

        def connection() -> asyncio.StreamReaderProtocol:
            reader = _Heard(self._expected, self._limits.head_bytes)
            return asyncio.StreamReaderProtocol(reader, self._serve)

        serving = loop.create_server(connection, sock=sock, backlog=_BACKLOG)
        self._server = asyncio.run_coroutine_threadsafe(serving, loop).result()
        return int(sock.getsockname()[1])

    def _admit(self, reader: _Heard, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        host = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        # Bytes the kernel held for it when it was handed over are its first, heard or not:
        # under TLS the reader hears only what the handshake decrypts, so a scrape mid-handshake
        # looked silent.
        reader.spoke = reader.spoke or bool(_unread(writer, 1))
        while len(self._open) >= self._limits.connections:
            victim = self._victim(host)
            del self._open[victim]
            self._answering.discard(victim)
            victim.transport.abort()
        self._open[writer] = host, reader

    def _victim(self, newcomer: str) -> asyncio.StreamWriter:
        """The connection a new one from `newcomer` replaces: of the host that holds the most
        (counting the new one, so a tie is the newcomer's), the oldest that sent nothing yet,
        else the oldest waiting for its request whose token has not come (neither among the
        bytes read nor among those waiting in the kernel), else the oldest waiting without a
        valid token, else the oldest waiting for its request, else the oldest. At most
        `connections` are looked at."""
        held = Counter(host for host, _ in self._open.values())
        held[newcomer] += 1
        busiest = max(held, key=lambda h: (held[h], h == newcomer))
        theirs = [w for w, (h, _) in self._open.items() if h == busiest]
        if not theirs:  # only the newcomer's own host, holding none yet: the oldest of all
            theirs = list(self._open)
        waiting = [w for w in theirs if w not in self._answering]
        unvouched = [w for w in waiting if not self._open[w][1].vouched]
        # Its bytes may have come and wait in the kernel, not yet read (a batch of connections
        # admitted before any is read, this thread starved on a loaded machine): what they
        # hold is looked at, lazily, the oldest first, as its reader will hear it.
        silent = (w for w in unvouched if not self._open[w][1].spoke and not _unread(w, 1))
        tokenless = (w for w in unvouched if not self._would_vouch(w))
        return next(silent, None) or next(tokenless, None) or (unvouched or waiting or theirs)[0]

    def _would_vouch(self, writer: asyncio.StreamWriter) -> bool:
        """Whether `writer`'s request vouches once its bytes waiting in the kernel are heard
        too. Under TLS they are ciphertext, unreadable here: any of them might hold a token."""
        if self._context is not None:
            return bool(_unread(writer, 1))
        heard = self._open[writer][1]
        room = heard.head_room()
        if not room:  # no token to look for, or its head ended: what it heard is all
            return heard.vouched
        return heard.would_vouch(_unread(writer, room + 1))  # a byte more: one too many ends it

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Admitted, and TLS started, before the first await: the client's first bytes reach
        # the TLS layer, not the reader.
        assert isinstance(reader, _Heard)  # `start`'s protocol makes one
        self._admit(reader, writer)
        try:
            try:
                async with asyncio.timeout(self._limits.request_s):
                    if self._context is not None:
                        await writer.start_tls(self._context)
                    head = await _head(reader)
            except (TimeoutError, OSError, EOFError, asyncio.LimitOverrunError):
                return  # no request: a failed handshake, a stranger, a slow or idle client
            self._answering.add(writer)
            writer.write(_encode(self._answer(head)))
            async with asyncio.timeout(self._limits.answer_s):
                writer.close()
                await writer.wait_closed()
        except (TimeoutError, OSError):
            pass  # a client that does not take its answer
        finally:
            self._open.pop(writer, None)
            self._answering.discard(writer)
            writer.transport.abort()

    def _answer(self, head: bytes) -> Answer:
        request = _parse(head)
        if request is None:
            self._refuse("not an HTTP request")
            return Answer(400, b"not an HTTP request\n")
        method, path, headers = request
        if self._expected is not None and not _authorized(headers, self._expected):
            self._refuse("no metrics token, or another")
            return Answer(
                401,
                b"this endpoint needs the swarm's metrics token: Authorization: Bearer <token>\n",
                (("WWW-Authenticate", 'Bearer realm="swarm"'),),
            )
        if method != "GET":
            return Answer(405, b"GET only\n", (("Allow", "GET"),))
        first = {name: values[0] for name, values in headers.items()}
        try:
            return self._handler(path, first)
        except Exception:
            log.exception("answering %s failed", path)
            return Answer(500, b"internal error\n")

    def _refuse(self, reason: str) -> None:
        self.refused += 1
        self._log.warning(reason, "metrics endpoint: refused a request: %s", reason)


def _unread(writer: asyncio.StreamWriter, most: int) -> bytes:
    """Up to `most` of the bytes waiting in the kernel for `writer`'s connection, left there
    (a peek): what its reader has yet to hear."""
    transport_socket = writer.get_extra_info("socket")
    if transport_socket is None or transport_socket.fileno() < 0:  # closed (a reset, say)
        return b""
    # asyncio's socket wrapper has no recv; a socket on the same descriptor, detached after
    # (never closed: the transport owns the descriptor), peeks without taking.
    try:
        sock = socket.socket(fileno=transport_socket.fileno())
    except OSError:
        return b""  # closed meanwhile
    try:
        sock.setblocking(False)  # never the process's default timeout: a peek never waits
        return sock.recv(most, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except OSError:
        return b""  # nothing waiting, or closed meanwhile
    finally:
        sock.detach()


async def _head(reader: asyncio.StreamReader) -> bytes:
    """The request's head, up to its blank line."""
    first = await reader.read(1)
    if not first:
        raise EOFError
    return first + await reader.readuntil(b"\r\n\r\n")


class _Heard(asyncio.StreamReader):
    """A connection's reader that notes, as its bytes arrive (before any task reads them),
    whether it `spoke` and whether its request's head vouches (`_Head`)."""

    def __init__(self, expected: bytes | None, head_bytes: int) -> None:
        super().__init__(limit=head_bytes)
        self._head = _Head(expected, head_bytes)
        self.spoke = False

    @property
    def vouched(self) -> bool:
        return self._head.vouched

    def head_room(self) -> int:
        """How many more bytes the head may take before it is none; 0 once it ended, or with
        no token to look for."""
        return self._head.room()

    def would_vouch(self, more: bytes) -> bool:
        """Whether the head vouches once `more` is heard too; nothing is heard here."""
        head = self._head.twin()
        head.hear(more)
        return head.vouched

    def feed_data(self, data: Iterable[SupportsIndex]) -> None:
        super().feed_data(data)
        chunk = bytes(data)  # the transport's bytes (typeshed types it as any byte source)
        self.spoke = self.spoke or bool(chunk)
        self._head.hear(chunk)


class _Head:
    """Whether a request's head, as heard so far, holds exactly one `Authorization` header whose
    bearer token is the endpoint's (`vouched`). Each head line is looked at once, as it
    completes; nothing past `head_bytes` or the blank line is kept."""

    def __init__(self, expected: bytes | None, head_bytes: int) -> None:
        self._expected, self._head_bytes = expected, head_bytes
        self._pending = bytearray()  # the head line being received
        self._seen = 0  # bytes looked at
        self._lines = 0  # head lines complete, the request line included
        self._tokens = 0  # Authorization lines among them
        self._ended = False  # the blank line came, or the head outgrew `head_bytes`
        self.vouched = False

    def room(self) -> int:
        return 0 if self._ended or self._expected is None else self._head_bytes - self._seen

    def twin(self) -> _Head:
        """A copy that hears on without this one hearing it."""
        twin = copy.copy(self)
        twin._pending = bytearray(self._pending)  # its own: `hear` extends it in place
        return twin

    def hear(self, chunk: bytes) -> None:
        if self._ended or self._expected is None:
            return
        self._seen += len(chunk)
        if self._seen > self._head_bytes:  # no head (the reader refuses it too)
            self._ended, self._pending, self.vouched = True, bytearray(), False
            return
        self._pending += chunk
        if b"\n" not in chunk:  # no line completed (a trickle costs no copy of the line)
            return
        *lines, rest = bytes(self._pending).split(b"\r\n")
        self._pending = bytearray(rest)
        for line in lines:
            self._lines += 1
            if self._lines > 1 and not line:  # the blank line: what follows is no header
                self._ended, self._pending = True, bytearray()
                return
            if self._lines > 1:
                self._heard(line)

    def _heard(self, line: bytes) -> None:
        name, colon, value = line.decode("latin-1").partition(":")
        if colon and name.strip().lower() == "authorization":
            self._tokens += 1
            assert self._expected is not None
            self.vouched = self._tokens == 1 and _bearer(value.strip(), self._expected)


def _parse(head: bytes) -> tuple[str, str, dict[str, list[str]]] | None:
    """(method, path without the query, headers) of a request head, or None if it is none."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        return None
    headers: dict[str, list[str]] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, colon, value = line.partition(":")
        if not colon:
            return None
        headers.setdefault(name.strip().lower(), []).append(value.strip())
    return parts[0], parts[1].partition("?")[0], headers


def _authorized(headers: Mapping[str, list[str]], expected: bytes) -> bool:
    values = headers.get("authorization", [])
    return len(values) == 1 and _bearer(values[0], expected)  # not none, nor two to choose from


def _bearer(value: str, expected: bytes) -> bool:
    """Whether an Authorization header's `value` is `Bearer <the token digested to expected>`."""
    scheme, _, credentials = value.partition(" ")
    if scheme.lower() != "bearer":  # RFC 6750: the scheme is case-insensitive
        return False
    given = hashlib.sha256(credentials.strip().encode()).digest()
    return hmac.compare_digest(given, expected)  # digests: equal lengths, no length leak


def _encode(answer: Answer) -> bytes:
    phrase = http.HTTPStatus(answer.status).phrase
    lines = [f"HTTP/1.1 {answer.status} {phrase}"]
    lines += [f"{name}: {value}" for name, value in answer.headers]
    lines += [f"Content-Length: {len(answer.body)}", "Connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1") + answer.body
