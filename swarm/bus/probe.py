"""What answers on a port given as the broker: the dialer asks it when a connect failed, so that a
port that is not an MQTT broker's (the scheduler's job API, a /metrics endpoint) is named as such
at once, rather than waited on as a broker that does not answer.

The question is one MQTT CONNECT (MQTT 3.1.1, clean session, no client id, no login), in clear
text or over TLS; a broker answers a CONNACK, accepting or refusing it, and anything else is
not a broker. Blocking: run it in a thread.
"""

from __future__ import annotations

import socket
import ssl
import time

__all__ = ["CONNECT", "answers_in_clear", "not_a_broker"]

# Fixed header (CONNECT, 12 bytes follow), "MQTT", level 4, clean session, keepalive 60 s, and
# an empty client id (the broker makes one up).
CONNECT = bytes([0x10, 12, 0, 4, *b"MQTT", 4, 0x02, 0, 60, 0, 0])
_CONNACK = 0x20
_HTTP2_FRAMES = (0x04, 0x07)  # SETTINGS (a server's first frame), GOAWAY
_TLS_RECORDS = (0x15, 0x16)  # alert, handshake
_FIX = "point --broker at the broker's port (the scheduler printed it at start)"


def not_a_broker(
    host: str, port: int, context: ssl.SSLContext | None, timeout: float
) -> str | None:
    """What answers on `host:port` instead of a broker, and what to do ("answered but is not an
    MQTT broker (...); point --broker at ..."); None when a broker answers, or nothing does
    (closed, silent or unreachable: a broker that is down or slow, said elsewhere). Over TLS
    with `context`."""
    reply = _reply(host, port, context, timeout)
    if not reply or reply[0] == _CONNACK:
        return None
    if len(reply) >= 9 and reply[0] == 0 and reply[3] in _HTTP2_FRAMES:
        looks = "it looks like a gRPC/HTTP2 server: the scheduler's --port?"
    elif reply.startswith(b"HTTP/"):
        looks = "it looks like an HTTP server: a --metrics-port?"
    elif reply[0] in _TLS_RECORDS and reply[1:2] == b"\x03":
        return None  # a TLS server: TLS on one side only, which the dialer tells apart
    else:
        looks = f"its first bytes: {reply[:8].hex(' ')}"
    return f"answered but is not an MQTT broker ({looks}); {_FIX}"


def answers_in_clear(host: str, port: int, timeout: float) -> bool:
    """Whether a broker answers on `host:port` in clear text (a CONNACK to a clear CONNECT): a
    port that said nothing to a TLS handshake, as a clear-text broker may, waiting for more of
    what it reads as an MQTT packet."""
    return _reply(host, port, None, timeout)[:1] == bytes([_CONNACK])


def _reply(host: str, port: int, context: ssl.SSLContext | None, timeout: float) -> bytes:
    """The first bytes (up to 9, enough for an HTTP/2 frame header) that `host:port` answers a
    CONNECT with, within `timeout` in all (a listener trickling a byte at a time waits no
    longer); b"" when it closes, stays silent or cannot be reached."""
    deadline = time.monotonic() + timeout
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError:
        return b""
    reply = b""
    try:
        if context is not None:
            sock = context.wrap_socket(sock, server_hostname=host)
        sock.sendall(CONNECT)
        while len(reply) < 9 and reply[:1] != bytes([_CONNACK]):  # a broker's says enough
            left = deadline - time.monotonic()
            if left <= 0:
                break
            sock.settimeout(left)
            chunk = sock.recv(9 - len(reply))
            if not chunk:
                break
            reply += chunk
    except OSError:  # reset, a failed handshake, a timeout: whatever came before it
        pass
    finally:
        sock.close()
    return reply
