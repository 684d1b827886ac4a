"""The embedded MQTT broker (amqtt): the one-machine default and the tests' in-process broker.

Production swarms point at Mosquitto or any MQTT 3.1.1 broker instead. amqtt keeps no state on
disk here: after a restart the retained topics are refilled by the clients (`swarm.bus.Bus`
re-publishes its retained messages on every reconnect). Two amqtt quirks to know: it speaks MQTT
3.1.1 only, and it does not enforce keepalive, so a peer whose host vanishes without closing its
TCP connection keeps its last-will pending until the operating system drops that connection.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
from typing import Self

from amqtt.broker import Broker
from amqtt.contexts import BrokerConfig, ListenerConfig, ListenerType
from amqtt.plugins.base import BaseAuthPlugin
from amqtt.session import Session

from swarm.topics import BusError

__all__ = ["DISCONNECT_GRACE_S", "EmbeddedBroker", "run_broker"]

log = logging.getLogger(__name__)

DISCONNECT_GRACE_S = 2
"""Seconds amqtt adds to a client's keepalive before giving up on it; paho pings only once a second
past the keepalive, so without grace an idle client would be cut off."""


class _TokenAuthPlugin(BaseAuthPlugin):
    """Accepts a client whose password equals the token; the username is not checked."""

    @dataclasses.dataclass
    class Config:
        token: str = ""

    async def authenticate(self, *, session: Session) -> bool | None:
        token: str = getattr(self.context.config, "token", "")
        password = session.password or ""
        if isinstance(password, bytes):
            password = password.decode("utf-8", "replace")
        if token and hmac.compare_digest(password.encode(), token.encode()):
            return True
        log.warning("broker: refused client %r: wrong or missing token", session.client_id)
        return False


def _quiet_amqtt() -> None:
    # amqtt logs every connection at INFO; keep it to warnings unless the user configured it.
    for name in ("amqtt", "transitions"):
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.WARNING)


class EmbeddedBroker:
    """An amqtt broker on `host:port` (port 0: a free one), for `async with`.

    Without `token` anyone may connect; with it, a client must send the token as its password.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: str | None = None) -> None:
        if not 0 <= port <= 65535:
            raise BusError(f"broker port {port} is outside 0..65535")
        self.host = host
        self._port = port
        self.token = token
        self._broker: Broker | None = None

    @property
    def port(self) -> int:
        """The listening port (the chosen one when constructed with port 0, once started)."""
        return self._port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"mqtt://{host}:{self._port}"

    async def start(self) -> None:
        if self._broker is not None:
            raise BusError("broker already started")
        _quiet_amqtt()
        auth = (
            {f"{__name__}._TokenAuthPlugin": {"token": self.token}}
            if self.token
            else {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}}
        )
        bind_host = f"[{self.host}]" if ":" in self.host else self.host
        config = BrokerConfig(
            listeners={
                "default": ListenerConfig(type=ListenerType.TCP, bind=f"{bind_host}:{self._port}")
            },
            timeout_disconnect_delay=DISCONNECT_GRACE_S,
            # Only auth: amqtt's default $SYS and packet-logging plugins cost time and log noise.
            plugins=auth,
        )
        broker = Broker(config)
        try:
            await broker.start()
        except Exception as exc:
            raise BusError(f"cannot start the embedded broker on {self.url}: {exc}") from exc
        self._broker = broker
        if self._port == 0:
            # amqtt exposes no API for the bound port; its listener is a plain asyncio server.
            server = broker._servers["default"].instance
            self._port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        log.info("broker: listening on %s%s", self.url, " (token required)" if self.token else "")

    async def stop(self) -> None:
        broker, self._broker = self._broker, None
        if broker is not None:
            await broker.shutdown()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


async def run_broker(host: str, port: int, token: str | None, stop: asyncio.Event) -> None:
    """Serve an embedded broker until `stop` is set (`swarm broker --port P`)."""
    async with EmbeddedBroker(host, port, token) as broker:
        log.info("broker: serving on %s until stopped", broker.url)
        await stop.wait()
