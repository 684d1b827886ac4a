"""The embedded MQTT broker (amqtt): the one-machine default and the tests' in-process broker.

Production swarms point at Mosquitto or any MQTT 3.1.1 broker instead. amqtt keeps no state on
disk here: after a restart the retained topics are refilled by the clients
(`swarm.bus.connection.Bus` re-publishes its retained messages on every reconnect). Two amqtt
quirks to know: it speaks MQTT 3.1.1 only, and it does not enforce keepalive, so a peer whose host
vanishes without closing its TCP connection keeps its last-will pending until the operating system
drops that connection. amqtt made the swarm's is `swarm.bus.acl_broker`; who logs in, and the
ACL, are `swarm.bus.gate`; what a connection may take (time, count, packet size, retained bytes,
queued bytes) is `swarm.bus.limits`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any, Self

from amqtt.broker import Broker
from amqtt.contexts import BrokerConfig, ListenerConfig, ListenerType

from swarm.bus.acl_broker import DISCONNECT_GRACE_S, AclBroker
from swarm.bus.amqtt_log import rate_amqtt_warnings
from swarm.bus.gate import Gate
from swarm.bus.limits import BrokerLimits
from swarm.bus.topics import DEFAULT_PREFIX, SCHEDULER_USER, BusError, Topics
from swarm.errors import ConfigError
from swarm.net import tls
from swarm.net.addresses import host_port, is_unspecified
from swarm.net.ports import Listener, bind_error, raise_if_taken

__all__ = ["DISCONNECT_GRACE_S", "EmbeddedBroker", "run_broker"]

log = logging.getLogger(__name__)


def _quiet_amqtt() -> None:
    # amqtt logs every connection at INFO; keep it to warnings unless the user configured it,
    # and those warnings rated (a stranger makes one per connection).
    rate_amqtt_warnings()
    for name in ("amqtt", "transitions"):
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.WARNING)


class EmbeddedBroker:
    """An amqtt broker on `host:port` (port 0: a free one), for `async with`.

    Without `token` anyone may connect; with it, a client must send the token as its password,
    and the scheduler (`SCHEDULER_USER`) its own, `scheduler_token` (made at random when not
    given, for a scheduler in this process to read here). With `use_identity_as_username`
    (mutual TLS only) a client's user is the name of its certificate (`swarm.bus.gate.Gate`).
    Either way a client that logs in with a username is held to the ACL of the swarm's topics
    under `prefix` (`Topics.may_publish`): the scheduler publishes anything, a peer (username =
    its peer id) only `peers/{peer}` and `peers/{peer}/load`, its last-will included. With a
    token every client has a username ("swarm" by default); without one, a client without a
    username is trusted with everything (an open broker has no identities). `limits` bound
    what strangers can take: the time to send a CONNECT, the connections held, the size of a
    packet (`BrokerLimits`).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        *,
        prefix: str = DEFAULT_PREFIX,
        announce_host: str = "",
        limits: BrokerLimits | None = None,
        scheduler_token: str | None = None,
        use_identity_as_username: bool = False,
    ) -> None:
        if not 0 <= port <= 65535:
            raise BusError(f"broker port {port} is outside 0..65535")
        self.host = host
        self.announce_host = announce_host  # the host in `url` (others dial it); "": `host`
        self._port = port
        self.token = token
        # With a token the scheduler needs its own; none given, one for a scheduler in-process.
        self.scheduler_token = scheduler_token or (secrets.token_urlsafe(24) if token else None)
        self.use_identity_as_username = use_identity_as_username
        self.prefix = Topics(prefix).prefix
        self.limits = limits or BrokerLimits()
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
            # None: amqtt's default $SYS and packet-logging plugins cost time and log noise; the
            # logins and the ACL are `_AclBroker`'s (keepalive grace included).
            plugins={},
        )
        mutual = identity is not None and identity.mutual
        if self.use_identity_as_username and not mutual:
            raise ConfigError(
                "--use-identity-as-username takes the MQTT user from the client's certificate: "
                "it needs --tls-mutual (with --tls-ca, --tls-cert, --tls-key)"
            )
        gate = Gate(
            Topics(self.prefix),
            self.token,
            self.scheduler_token,
            use_identity_as_username=self.use_identity_as_username,
        )
        broker = AclBroker(config, gate=gate, limits=self.limits, mutual=mutual)
        if self._port:  # said in one line, not amqtt's traceback
            taken = bind_error(self.host, self._port)
            raise_if_taken(taken, self.host, self._port, Listener.BROKER)
        try:
            await broker.start()
        except Exception as exc:
            raise_if_taken(exc.__cause__, self.host, self._port, Listener.BROKER)
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


async def run_broker(
    host: str,
    port: int,
    token: str | None,
    stop: asyncio.Event,
    *,
    scheduler_token: str | None = None,
    use_identity_as_username: bool = False,
) -> None:
    """Serve an embedded broker until `stop` is set (`swarm broker --port P`)."""
    async with EmbeddedBroker(
        host,
        port,
        token,
        scheduler_token=scheduler_token,
        use_identity_as_username=use_identity_as_username,
    ) as broker:
        if token and not scheduler_token:
            log.warning(
                "broker: no --scheduler-token (SWARM_SCHEDULER_TOKEN): no scheduler can log in "
                "but one whose certificate is named %r (--use-identity-as-username)",
                SCHEDULER_USER,
            )
        log.info("broker: serving on %s until stopped", broker.url)
        await stop.wait()
