"""The embedded MQTT broker (amqtt): the one-machine default and the tests' in-process broker.

Production swarms point at Mosquitto or any MQTT 3.1.1 broker instead. amqtt keeps no state on
disk here: after a restart the retained topics are refilled by the clients
(`swarm.bus.connection.Bus`
re-publishes its retained messages on every reconnect). Two amqtt quirks to know: it speaks MQTT
3.1.1 only, and it does not enforce keepalive, so a peer whose host vanishes without closing its
TCP connection keeps its last-will pending until the operating system drops that connection.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import ssl
from typing import Any, Self

from amqtt.broker import Broker
from amqtt.contexts import Action, BrokerConfig, ListenerConfig, ListenerType
from amqtt.plugins.base import BaseAuthPlugin
from amqtt.session import Session

from swarm.bus.topics import DEFAULT_PREFIX, BusError, Topics
from swarm.net import tls
from swarm.net.addresses import host_port, is_unspecified

__all__ = ["DISCONNECT_GRACE_S", "EmbeddedBroker", "run_broker"]

log = logging.getLogger(__name__)

DISCONNECT_GRACE_S = 2
"""Seconds amqtt adds to a client's keepalive before giving up on it; paho pings only once a second
past the keepalive, so without grace an idle client would be cut off."""


def _text(value: str | bytes | None) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value or ""


class _AuthPlugin(BaseAuthPlugin):
    """Accepts a client whose password equals the token (with a token; without one, anyone),
    and whose last-will, if any, is on a topic the ACL lets its user publish: a peer cannot make
    another peer look offline when it disconnects."""

    @dataclasses.dataclass
    class Config:
        token: str = ""
        prefix: str = DEFAULT_PREFIX

    async def authenticate(self, *, session: Session) -> bool | None:
        token: str = getattr(self.context.config, "token", "")
        if token and not hmac.compare_digest(_text(session.password).encode(), token.encode()):
            log.warning("broker: refused client %r: wrong or missing token", session.client_id)
            return False
        if session.will_flag and not _may_publish(
            getattr(self.context.config, "prefix", DEFAULT_PREFIX),
            bool(token),
            session.username,
            _text(session.will_topic),
        ):
            log.warning(
                "broker: refused client %r (user %r): its last-will is on %r, not its own topic",
                session.client_id,
                session.username,
                session.will_topic,
            )
            return False
        return True


def _may_publish(prefix: str, token: bool, user: str | None, topic: str) -> bool:
    """The ACL (`Topics.may_publish`); a client without a username on a broker without a token
    is trusted with everything (an open broker: there is no identity to check)."""
    if not user and not token:
        return True
    return Topics(prefix).may_publish(user, topic)


class _AclBroker(Broker):
    """amqtt's broker with the swarm's ACL (`Topics.may_publish`) on PUBLISH: a refused message
    is dropped (MQTT 3.1.1 has no way to say no) and logged; subscribing and receiving are open.

    Not a topic plugin: amqtt awaits a plugin for every recipient of every message while it
    iterates over its subscriptions, so a SUBSCRIBE landing meanwhile breaks that broadcast
    ("dictionary changed size during iteration"), and each check costs a task. This check is
    synchronous; amqtt's filtering hook is private API (pinned amqtt version, tested)."""

    def __init__(self, config: BrokerConfig, *, prefix: str, token: bool, mutual: bool) -> None:
        super().__init__(config)
        self._acl_prefix, self._acl_token, self._mutual = prefix, token, mutual

    def _create_ssl_context(self, listener: ListenerConfig) -> ssl.SSLContext:  # type: ignore[override]
        context = Broker._create_ssl_context(listener)
        if self._mutual:  # amqtt asks for a client certificate but lets one without it in
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    async def _topic_filtering(self, session: Session, topic: str, action: Action) -> bool:
        if action != Action.PUBLISH:
            return True
        user = session.username if session is not None else None
        if _may_publish(self._acl_prefix, self._acl_token, user, topic or ""):
            return True
        log.warning("broker: dropped a message from user %r on %r: not its topic", user, topic)
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
    Either way a client that logs in with a username is held to the ACL of the swarm's topics
    under `prefix` (`Topics.may_publish`): the scheduler (`SCHEDULER_USER`) publishes anything,
    a peer (username = its peer id) only `peers/{peer}` and `jobs/+/load/{peer}`, its last-will
    included. With a token every client has a username ("swarm" by default); without one, a
    client without a username is trusted with everything (an open broker has no identities).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        *,
        prefix: str = DEFAULT_PREFIX,
        announce_host: str = "",
    ) -> None:
        if not 0 <= port <= 65535:
            raise BusError(f"broker port {port} is outside 0..65535")
        self.host = host
        self.announce_host = announce_host  # the host in `url` (others dial it); "": `host`
        self._port = port
        self.token = token
        self.prefix = Topics(prefix).prefix
        self._broker: Broker | None = None

    @property
    def port(self) -> int:
        """The listening port (the chosen one when constructed with port 0, once started)."""
        return self._port

    @property
    def scheme(self) -> str:
        """mqtts when the process has a TLS identity: the broker then serves TLS only."""
        return "mqtts" if tls.current() is not None else "mqtt"

    @property
    def url(self) -> str:
        """Where clients connect: the announced host (`announce_host`, else the bound one)."""
        return f"{self.scheme}://{host_port(self.announce_host or self.host, self._port)}"

    @property
    def local_url(self) -> str:
        """Where a client on this machine connects (the bound host; loopback when it listens on
        every interface): the announced address may not route back here, behind NAT."""
        host = self.host
        if is_unspecified(host):
            host = "::1" if ":" in host else "127.0.0.1"
        return f"{self.scheme}://{host_port(host, self._port)}"

    async def start(self) -> None:
        if self._broker is not None:
            raise BusError("broker already started")
        _quiet_amqtt()
        plugins = {f"{__name__}._AuthPlugin": {"token": self.token or "", "prefix": self.prefix}}
        identity = tls.current()
        secure: dict[str, Any] = {}
        if identity is not None:
            identity.server_credentials("the embedded broker")  # says which flags it lacks
            secure = {
                "ssl": True,
                "cafile": identity.ca_path,
                "certfile": identity.cert_path,
                "keyfile": identity.key_path,
            }
        config = BrokerConfig(
            listeners={
                "default": ListenerConfig(
                    type=ListenerType.TCP, bind=host_port(self.host, self._port), **secure
                )
            },
            timeout_disconnect_delay=DISCONNECT_GRACE_S,
            # Auth only: amqtt's default $SYS and packet-logging plugins cost time and log noise.
            plugins=plugins,
        )
        mutual = identity is not None and identity.mutual
        broker = _AclBroker(config, prefix=self.prefix, token=bool(self.token), mutual=mutual)
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
