"""What the bus says when it cannot connect, against real brokers: TLS on one side only (within
one CONNACK timeout, not after the caller's whole wait), a login refused for an unknown user or a
wrong password (each with what to check), and a broker that does not answer (at once, then at
every attempt until the caller gives up)."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc
from prometheus_client import CollectorRegistry

from swarm.bus.broker import EmbeddedBroker
from swarm.bus.connection import (
    Bus,
    BusAuthError,
    BusNotConnected,
    BusRefused,
    BusSettings,
    BusTlsMismatch,
)
from swarm.net import tls
from swarm.net.tokens import add_port
from tests.support.brokers import Mosquitto
from tests.support.ports import free_port
from tests.support.tls import REFUSED_SOCKETS, load_identity, no_identity  # noqa: F401

pytestmark = pytest.mark.timeout(60)

# A CONNACK that does not come in 1 s is late: the mismatch is found after it, well within WAIT_S.
QUICK = BusSettings(keepalive_s=2, operation_timeout_s=1.0, close_timeout_s=3.0)
WAIT_S = 15.0
TOKEN = "s3cret"


def _bus(url: str, name: str, **kwargs: object) -> Bus:
    return Bus(url, name, registry=CollectorRegistry(), settings=QUICK, **kwargs)  # type: ignore[arg-type]


async def _refusal(url: str, name: str = "peer-a", **kwargs: object) -> BaseException:
    """The error `wait_connected` raises, and how long it took."""
    async with _bus(url, name, **kwargs) as bus:
        started = time.monotonic()
        with pytest.raises(Exception) as caught:
            await bus.wait_connected(WAIT_S)
        assert time.monotonic() - started < WAIT_S / 2, "the cause was not found before the wait"
        return caught.value


@REFUSED_SOCKETS
@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual"])
async def test_mqtt_to_a_tls_mosquitto_says_use_mqtts(
    tmp_path: Path, pki: Path, mutual: bool
) -> None:
    server = load_identity(pki, "ours", "server", mutual=mutual)
    with Mosquitto(tmp_path / "mosquitto", tls=server) as mosquitto:
        plain = mosquitto.url.replace("mqtts://", "mqtt://")
        error = await _refusal(plain)
    assert isinstance(error, BusTlsMismatch), error
    assert f"speaks TLS: use mqtts://127.0.0.1:{mosquitto.port}" in str(error)
    assert ("requires a client certificate" in str(error)) == mutual


@REFUSED_SOCKETS
async def test_mqtt_to_the_embedded_tls_broker_says_use_mqtts(pki: Path) -> None:
    tls.configure(load_identity(pki, "ours", "server"))
    async with EmbeddedBroker("127.0.0.1", 0) as broker:
        tls.configure(None)
        error = await _refusal(broker.url.replace("mqtts://", "mqtt://"))
    assert isinstance(error, BusTlsMismatch), error
    assert f"use mqtts://127.0.0.1:{broker.port}" in str(error)


@REFUSED_SOCKETS
async def test_mqtts_to_a_clear_text_broker_says_use_mqtt(tmp_path: Path, pki: Path) -> None:
    tls.configure(load_identity(pki, "ours", "client"))
    with Mosquitto(tmp_path / "mosquitto") as mosquitto:
        error = await _refusal(mosquitto.url.replace("mqtt://", "mqtts://"))
    assert isinstance(error, BusTlsMismatch), error
    assert f"does not speak TLS: use mqtt://127.0.0.1:{mosquitto.port}" in str(error)


@REFUSED_SOCKETS
async def test_mqtts_to_the_embedded_clear_text_broker_says_use_mqtt(pki: Path) -> None:
    # amqtt reads a ClientHello as the start of a packet and waits for the rest: the handshake
    # gets no answer, where Mosquitto closes the connection.
    async with EmbeddedBroker("127.0.0.1", 0) as broker:
        tls.configure(load_identity(pki, "ours", "client"))
        error = await _refusal(broker.url.replace("mqtt://", "mqtts://"))
    assert isinstance(error, BusTlsMismatch), error
    assert f"does not speak TLS: use mqtt://127.0.0.1:{broker.port}" in str(error)


@REFUSED_SOCKETS
async def test_a_certificate_refused_by_either_side_is_named(tmp_path: Path, pki: Path) -> None:
    server = load_identity(pki, "ours", "server", mutual=True)
    with Mosquitto(tmp_path / "mosquitto", tls=server) as mosquitto:
        tls.configure(load_identity(pki, "ours", None))  # the CA, but no certificate of its own
        lacking = await _refusal(mosquitto.url)
        tls.configure(load_identity(pki, "theirs", "their-client"))  # trusts another CA
        stranger = await _refusal(mosquitto.url)
    assert isinstance(lacking, BusRefused), lacking
    assert "TLS refused: the broker at" in str(lacking)
    assert "requires a client certificate: give --tls-cert and --tls-key" in str(lacking)
    assert isinstance(stranger, BusRefused), stranger
    assert "certificate of the broker at" in str(stranger)
    assert f"was not issued by the CA of --tls-ca {pki / 'theirs' / 'ca.pem'}" in str(stranger)


async def test_a_user_missing_from_the_password_file_is_told_apart_from_a_wrong_token(
    tmp_path: Path,
) -> None:
    # Mosquitto answers "not authorised" to both: the message names both causes, and the
    # helper that writes the password file.
    with Mosquitto(tmp_path / "mosquitto", users={"peer-a": TOKEN}) as mosquitto:
        error = await _refusal(mosquitto.url, username="peer-b", token=TOKEN)
    assert isinstance(error, BusAuthError), error
    text = str(error)
    assert "refused user 'peer-b': not authorised" in text
    assert "does not know 'peer-b'" in text and "swarm broker-config --peers" in text
    assert "--peer" in text and "SWARM_TOKEN" in text
    # The embedded broker knows the token only: a wrong one is a bad password, said so.
    async with EmbeddedBroker("127.0.0.1", 0, token=TOKEN) as broker:
        error = await _refusal(broker.url, username="peer-a", token="guess")
    assert isinstance(error, BusAuthError), error
    assert "refused user 'peer-a': bad user name or password" in str(error)
    assert "check the token (--token, SWARM_TOKEN)" in str(error)


async def test_a_broker_that_does_not_answer_is_reported_at_once_then_at_every_attempt(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"mqtt://127.0.0.1:{free_port('127.0.0.1')}"  # nothing listens there
    caplog.set_level(logging.WARNING, logger="swarm.bus.connection")
    async with _bus(url, "peer-a") as bus:
        started = time.time()
        with pytest.raises(BusNotConnected, match="Connection refused"):
            await bus.wait_connected(2.5)
    lines = [r for r in caplog.records if "does not answer" in r.getMessage()]
    assert lines, caplog.text
    assert lines[0].created - started < 1.0  # said within a second, not after the wait
    shown = [
        re.search(r"attempt (\d+) failed, next in [\d.]+ s; giving up in (\d+) s", r.getMessage())
        for r in lines
    ]
    assert all(shown), [r.getMessage() for r in lines]
    attempts = [int(m.group(1)) for m in shown if m]
    assert attempts == list(range(1, len(attempts) + 1)) and len(attempts) >= 3
    assert url in lines[0].getMessage() and "Connection refused" in lines[0].getMessage()
    assert int(shown[0].group(2)) <= 3  # type: ignore[union-attr]


NOT_A_BROKER = (
    "answered but is not an MQTT broker (it looks like a gRPC/HTTP2 server: the scheduler's "
    "--port?); point --broker at the broker's port (the scheduler printed it at start)"
)


@REFUSED_SOCKETS
@pytest.mark.parametrize("scheme", ["mqtt", "mqtts", "mqtt-to-tls"])
async def test_a_grpc_port_given_as_the_broker_is_named_within_a_second(
    pki: Path, scheme: str
) -> None:
    # The scheduler's job API where its broker was meant: paho reads an HTTP/2 frame as
    # "Unrecognised command 0" and waited out the CONNACK at every attempt until the caller
    # gave up (30 s).
    if scheme != "mqtt":
        tls.configure(load_identity(pki, "ours", "server"))
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = add_port(server, "127.0.0.1:0", "the scheduler")
    await server.start()
    try:
        url = f"{'mqtts' if scheme == 'mqtts' else 'mqtt'}://127.0.0.1:{port}"
        async with Bus(url, "peer-a", registry=CollectorRegistry()) as bus:  # default timings
            started = time.monotonic()
            with pytest.raises(BusRefused) as caught:
                await bus.wait_connected(WAIT_S)
            took = time.monotonic() - started
    finally:
        await server.stop(None)
    assert f"{url} {NOT_A_BROKER}" in str(caught.value), caught.value
    assert took < 1.5, f"{took:.1f} s"
