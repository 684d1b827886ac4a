"""A host that churns connections to a metrics endpoint (opening them as fast as it can, closing
or abandoning them) never cuts off another host's scrape (issue 44, N14); refused scrapes are
counted, each one, and logged rated (N16)."""

from __future__ import annotations

import hashlib
import logging
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from swarm.ops.endpoint import Answer, Endpoint

CHURNER = """
import socket, sys, time
port, mode, host = int(sys.argv[1]), sys.argv[2], sys.argv[3]
held = []
while True:
    s = socket.socket()
    s.bind((host, 0))  # 127.0.0.2: another host than the scrape's
    try:
        s.connect(("127.0.0.1", port))
    except OSError:
        s.close()
        continue
    if mode == "close":
        s.close()
    elif mode == "trickle":  # slowloris: a request begun, a header now and then, never ended
        s.sendall(b"GET /metrics HTTP/1.1\\r\\nHost: x\\r\\n")
        held.append(s)
        if len(held) > 200:
            held.pop(0).close()
        if len(held) % 50 == 0:
            for h in held:
                try:
                    h.sendall(b"X-Trickle: 1\\r\\n")
                except OSError:
                    pass
    else:
        held.append(s)
        if len(held) > 200:
            held.pop(0).close()
"""
BODY = b"swarm_test_series 1\n" * 20_000  # 400 KB: a large swarm's scrape


def _scrape(port: int, pause_s: float, token_first: bool = False, silent_s: float = 0.0) -> bytes:
    """A scrape from 127.0.0.1 over a slow link: its request comes in two parts `pause_s` apart
    (well within the endpoint's `request_s`); the token in the first part if `token_first`; with
    `silent_s`, that long between its connect and its first bytes (a starved client thread)."""
    first, second = b"GET /metrics HTTP/1.1\r\n", b"Authorization: Bearer s3cret\r\n\r\n"
    if token_first:
        first, second = first + second[:-2], b"Accept: text/plain\r\n\r\n"
    with socket.socket() as s:
        if silent_s:
            s.connect(("127.0.0.1", port))
            time.sleep(silent_s)
            s.sendall(first)
        else:
            # The request's first part leaves with the connect, in one call (TCP Fast Open's
            # sendto; without the server's cookie the kernel sends it right after the
            # handshake), as a scrape's does.
            s.sendto(first, socket.MSG_FASTOPEN, ("127.0.0.1", port))
        s.settimeout(30)  # after: a sendto on a socket with a timeout would not wait
        time.sleep(pause_s)
        s.sendall(second)
        answer = b""
        while chunk := s.recv(1 << 16):
            answer += chunk
        return answer


@pytest.mark.attack("N14")
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["close", "hold"])
def test_churn_from_another_host_never_cuts_a_scrape_off(mode: str) -> None:
    endpoint = Endpoint(lambda path, headers: Answer(200, BODY), token="s3cret")
    port = endpoint.start("127.0.0.1", 0)
    _scrapes_through_churn(port, mode, "127.0.0.2")


@pytest.mark.attack("N14")
@pytest.mark.timeout(180)
def test_a_silent_flood_from_the_scrapers_own_host_never_cuts_a_scrape_off() -> None:
    # Issue 54 (N14 still open): the flood's host is the scrape's, so "the host that holds the
    # most" is the scrape's too; its oldest connection waiting for a request was dropped, the
    # scrape among them (1 of 7 got through). A connection that has sent nothing goes first.
    endpoint = Endpoint(lambda path, headers: Answer(200, BODY), token="s3cret")
    port = endpoint.start("127.0.0.1", 0)
    _scrapes_through_churn(port, "hold", "127.0.0.1")


@pytest.mark.attack("N14")
@pytest.mark.timeout(180)
def test_a_flood_of_partial_requests_from_the_scrapers_own_host_never_cuts_a_scrape_off() -> None:
    # Issue 54 (N14 under slowloris): the flood's connections each send a request line, then a
    # header now and then, never the blank line; the scrape's host is theirs. Before, a scrape
    # that had begun its request was "the oldest waiting for its request" and dropped like them
    # (under a flood, within its first second). Its token, once its header is in, vouches for it.
    endpoint = Endpoint(lambda path, headers: Answer(200, BODY), token="s3cret")
    port = endpoint.start("127.0.0.1", 0)
    _scrapes_through_churn(port, "trickle", "127.0.0.1", token_first=True)


@pytest.mark.attack("N14")
@pytest.mark.timeout(180)
def test_a_scrape_slow_to_speak_is_not_dropped_as_silent_by_its_hosts_flood() -> None:
    # Seen in CI (1 run in 4, the test above): a scrape's connection accepted before its first
    # bytes arrived looked silent, the only one of its host's as the flood's all spoke at once,
    # and was dropped before them. A client thread starved between its connect and its send (a
    # loaded machine) is that scrape, deterministically: silent for 0.2 s.
    endpoint = Endpoint(lambda path, headers: Answer(200, BODY), token="s3cret")
    port = endpoint.start("127.0.0.1", 0)
    _scrapes_through_churn(port, "trickle", "127.0.0.1", token_first=True, silent_s=0.2)


def _scrapes_through_churn(
    port: int, mode: str, host: str, token_first: bool = False, silent_s: float = 0.0
) -> None:
    """Five scrapes from 127.0.0.1, side by side, while a process churns connections from
    `host` (one after another, their pauses were 5 s of each test)."""
    churner = subprocess.Popen([sys.executable, "-c", CHURNER, str(port), mode, host])
    try:
        time.sleep(1.0)  # churning
        with ThreadPoolExecutor(5) as pool:
            scrapes = [pool.submit(_scrape, port, 1.0, token_first, silent_s) for _ in range(5)]
            for scrape in scrapes:
                try:
                    answer = scrape.result()
                except (ConnectionResetError, BrokenPipeError) as e:
                    pytest.fail(f"a scrape was cut off: {e}")
                assert answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith(BODY)
        assert churner.poll() is None  # it churned all along
    finally:
        churner.kill()
        churner.wait()


@pytest.mark.attack("N16")
@pytest.mark.timeout(120)
def test_refused_scrapes_are_counted_and_logged_rated(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="swarm.ops.endpoint")
    endpoint = Endpoint(lambda path, headers: Answer(200, b"ok\n"), token="s3cret")
    port = endpoint.start("127.0.0.1", 0)
    started = time.monotonic()
    for i in range(1000):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\n\r\n" if i % 2 else b"hello\r\n\r\n")
            assert s.recv(64).startswith((b"HTTP/1.1 401", b"HTTP/1.1 400"))
    assert endpoint.refused == 1000
    lines = [r for r in caplog.records if r.name == "swarm.ops.endpoint"]
    # A line per reason (two here) and 10 s, however many refusals.
    bound = 2 * (1 + int((time.monotonic() - started) / 10))
    assert 2 <= len(lines) <= bound, f"{len(lines)} log lines for 1,000 refusals"


@pytest.mark.parametrize(
    ("chunks", "vouched"),
    [
        ([b"GET / HTTP/1.1\r\nAuthorization: Bearer s3cret\r\n"], True),
        ([b"GET / HTTP/1.1\r\nAuthor", b"ization: bearer s3c", b"ret\r", b"\nX: y\r\n"], True),
        ([b"GET / HTTP/1.1\r\nAuthorization: Bearer s3cret"], False),  # the line not ended
        ([b"GET / HTTP/1.1\r\nAuthorization: Bearer wrong\r\n"], False),
        ([b"GET / HTTP/1.1\r\nAuthorization: Bearer s3cret\r\nAuthorization: Bearer x\r\n"], False),
        ([b"GET / HTTP/1.1\r\n\r\nAuthorization: Bearer s3cret\r\n"], False),  # past the head
        ([b"Authorization: Bearer s3cret\r\n"], False),  # the request line is no header
    ],
)
async def test_a_token_vouches_for_its_request_as_its_header_line_arrives(
    chunks: list[bytes], vouched: bool
) -> None:
    from swarm.ops.endpoint import _Heard

    heard = _Heard(hashlib.sha256(b"s3cret").digest(), 16 * 1024)
    for chunk in chunks:
        heard.feed_data(chunk)
    assert heard.spoke and heard.vouched == vouched


async def test_what_waiting_bytes_would_vouch_for_is_heard_on_a_copy() -> None:
    """A connection's waiting bytes (a peek) are heard on a copy of its reader's state: the
    token may be split between what was read and what waits, and the reader, which hears
    those bytes again when it reads them, is left as it was."""
    from swarm.ops.endpoint import _Heard

    heard = _Heard(hashlib.sha256(b"s3cret").digest(), 16 * 1024)
    heard.feed_data(b"GET / HTTP/1.1\r\nAuthorization: Bea")
    assert heard.would_vouch(b"rer s3cret\r\n")
    assert not heard.would_vouch(b"rer s3cret")  # the line not ended
    assert not heard.would_vouch(b"rer wrong\r\n")
    assert not heard.would_vouch(b"rer s3cret\r\nAuthorization: Bearer s3cret\r\n")  # two
    assert not heard.vouched
    heard.feed_data(b"rer s3cret\r\n")  # read at last: heard once
    assert heard.vouched
    assert not heard.would_vouch(b"Authorization: Bearer s3cret\r\n")  # a second would undo it
    assert heard.vouched
