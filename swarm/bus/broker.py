"""The embedded MQTT broker (amqtt): the one-machine default and the tests' in-process broker.

Production swarms point at Mosquitto or any MQTT 3.1.1 broker instead. amqtt keeps no state on
disk here: after a restart the retained topics are refilled by the clients
(`swarm.bus.connection.Bus` re-publishes its retained messages on every reconnect). Two amqtt
quirks to know: it speaks MQTT 3.1.1 only, and it does not enforce keepalive, so a peer whose host
vanishes without closing its TCP connection keeps its last-will pending until the operating system
drops that connection. Who logs in, and the ACL, are `swarm.bus.gate`; what a connection may take
(time, count, packet size) is `swarm.bus.limits`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import ssl
from collections.abc import Iterator
from typing import Any, Self

from amqtt.adapters import ReaderAdapter, StreamReaderAdapter, StreamWriterAdapter, WriterAdapter
from amqtt.broker import Broker
from amqtt.contexts import Action, BrokerConfig, ListenerConfig, ListenerType
from amqtt.errors import AMQTTError, MQTTError, NoDataError
from amqtt.mqtt.connack import ConnackPacket
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
from amqtt.session import Session
from amqtt.utils import gen_client_id

from swarm.bus.gate import Gate
from swarm.bus.limits import BrokerLimits, PacketCap, PacketTooLarge, RefusalLog
from swarm.bus.topics import DEFAULT_PREFIX, SCHEDULER_USER, BusError, Topics
from swarm.errors import ConfigError
from swarm.net import tls
from swarm.net.addresses import host_port, is_unspecified
from swarm.net.ports import Listener, bind_error, raise_if_taken

__all__ = ["DISCONNECT_GRACE_S", "EmbeddedBroker", "run_broker"]

log = logging.getLogger(__name__)

DISCONNECT_GRACE_S = 2
"""Seconds the broker adds to a client's keepalive before giving up on it; paho pings only once a
second past the keepalive, so without grace an idle client would be cut off."""


async def _close(writer: WriterAdapter) -> None:
    with contextlib.suppress(Exception):
        await writer.close()


class _Snapshots(dict[str, Any]):
    """amqtt's subscriptions by topic, walked over a copy of the topics: a connecting client's
    walk (sending it the retained messages of every topic subscribed to) awaits at each topic,
    and a SUBSCRIBE or a disconnect landing meanwhile changed the dictionary under it (its
    RuntimeError was an `ERROR asyncio` traceback, and that client's connection reset)."""

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.keys()))


class _AclBroker(Broker):
    """amqtt's broker behind the swarm's `Gate`: every CONNECT is checked before amqtt touches a
    session, a last-will passes the ACL again when it is sent, and a PUBLISH the ACL refuses is
    dropped (MQTT 3.1.1 has no way to say no) and logged; subscribing and receiving are open.

    The hooks are amqtt's private methods (pinned amqtt version; tests/swarm/bus/ drive each
    through a real broker, so a version that moved one fails them). Not a topic plugin: amqtt
    awaits a plugin for every recipient of every message while it iterates over its
    subscriptions, so a SUBSCRIBE landing meanwhile breaks that broadcast ("dictionary changed
    size during iteration"), and each check costs a task. This check is synchronous."""

    def __init__(
        self, config: BrokerConfig, *, gate: Gate, limits: BrokerLimits, mutual: bool
    ) -> None:
        super().__init__(config)
        self._gate, self._limits, self._mutual = gate, limits, mutual
        self._open = 0  # connections held, logged in or not
        self._refusals, self._login_refusals = RefusalLog(), RefusalLog()  # full; wrong login
        self._subscriptions = _Snapshots(self._subscriptions)  # type: ignore[has-type]

    async def _create_server_instance(
        self,
        listener_name: str,
        listener_type: ListenerType,
        address: str | None,
        port: int,
        ssl_context: ssl.SSLContext | None,
    ) -> Any:
        # amqtt's, with a bound on the TLS handshake: a stranger's silent connection is closed
        # before the broker ever sees it (asyncio's default would hold it a minute).
        if listener_type != ListenerType.TCP:
            return await super()._create_server_instance(
                listener_name, listener_type, address, port, ssl_context
            )
        return await asyncio.start_server(
            functools.partial(self.stream_connected, listener_name=listener_name),
            address,
            port,
            reuse_address=True,
            ssl=ssl_context,
            ssl_handshake_timeout=self._limits.connect_timeout_s if ssl_context else None,
        )

    async def stream_connected(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, listener_name: str
    ) -> None:
        capped = PacketCap(StreamReaderAdapter(reader), self._limits.max_packet_bytes)
        try:
            await self._client_connected(listener_name, capped, StreamWriterAdapter(writer))
        except asyncio.CancelledError:
            # The broker stops with this connection still open (a client not logged in yet):
            # the connection ends here. Raised on, Python 3.11's stream callback reads the
            # cancelled task's exception() and logs an `ERROR asyncio` traceback at every
            # clean shutdown; nothing awaits this task.
            writer.transport.abort()

    def _create_ssl_context(self, listener: ListenerConfig) -> ssl.SSLContext:  # type: ignore[override]
        context = Broker._create_ssl_context(listener)
        if self._mutual:  # amqtt asks for a client certificate but lets one without it in
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    async def _client_connected(
        self, listener_name: str, reader: ReaderAdapter, writer: WriterAdapter
    ) -> None:
        if self._open >= self._limits.max_connections:
            self._refusals.refused(
                f"closed a new connection: {self._open} held already, "
                f"the limit (limits.max_connections={self._limits.max_connections})"
            )
            await _close(writer)
            return
        self._open += 1
        try:
            await super()._client_connected(listener_name, reader, writer)
        finally:
            self._open -= 1
            self._gate.release(asyncio.current_task())

    async def _initialize_client_session(
        self, reader: ReaderAdapter, writer: WriterAdapter, remote_address: str, remote_port: int
    ) -> tuple[BrokerProtocolHandler, Session]:
        # amqtt's own deletes or takes over the CONNECT's client id before authenticating; this
        # one reads the CONNECT, asks the gate, and only then touches the sessions.
        timeout_s = self._limits.connect_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                handler, session = await BrokerProtocolHandler.init_from_connect(
                    reader, writer, self.plugins_manager
                )
        except TimeoutError:
            log.info(
                "broker: closed %s: no CONNECT within %.1f s (limits.connect_timeout_s)",
                host_port(remote_address, remote_port),
                timeout_s,
            )
            await _close(writer)
            raise AMQTTError(f"no CONNECT within {timeout_s} s") from None
        except PacketTooLarge as exc:  # in the CONNECT: made an error amqtt's caller handles
            await _close(writer)
            raise MQTTError(str(exc)) from exc
        except (AMQTTError, MQTTError, NoDataError):
            await _close(writer)
            raise
        refusal = self._gate.admit(session)
        if refusal is not None:
            self._login_refusals.refused(
                f"refused client {session.client_id!r} (user {session.username!r}) from "
                f"{host_port(remote_address, remote_port)}: {refusal.reason}"
            )
            with contextlib.suppress(Exception):
                await ConnackPacket.build(0, refusal.code).to_stream(writer)
            await _close(writer)
            raise MQTTError(f"refused: {refusal.reason}")
        if not session.client_id:
            session.client_id = gen_client_id()
        self._gate.claim(session, asyncio.current_task())  # released when this connection ends
        held = self._sessions.get(session.client_id)
        if held is not None and held[0].transitions.is_connected():
            # The same user again (the gate refused any other): drop the old connection, as MQTT
            # says, rather than leave it connected without its subscriptions.
            log.info("broker: client %r again; closing its old connection", session.client_id)
            await held[1].handle_connection_closed()
            await held[1].stop()
        await self._delete_session(session.client_id)
        session.parent = 0
        if session.keep_alive > 0:
            session.keep_alive += DISCONNECT_GRACE_S
        return handler, session

    async def _authenticate(self, session: Session, _: ListenerConfig) -> bool:
        return self._gate.admit(session) is None  # checked again, had amqtt moved the hook

    async def _handle_disconnect(
        self, client_session: Session, handler: BrokerProtocolHandler, disconnect_waiter: Any
    ) -> None:
        if client_session.will_flag and not self._gate.may_publish(
            client_session.username, client_session.will_topic or ""
        ):
            log.warning(
                "broker: dropped the last-will of user %r on %r: not its topic",
                client_session.username,
                client_session.will_topic,
            )
            client_session.will_flag = False
        await super()._handle_disconnect(client_session, handler, disconnect_waiter)

    async def _topic_filtering(self, session: Session, topic: str, action: Action) -> bool:
        if action != Action.PUBLISH:
            return True
        user = session.username if session is not None else None
        if self._gate.may_publish(user, topic or ""):
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

    Without `token` anyone may connect; with it, a client must send the token as its password,
    and the scheduler (`SCHEDULER_USER`) its own, `scheduler_token` (made at random when not
    given, for a scheduler in this process to read here). With `use_identity_as_username`
    (mutual TLS only) a client's user is the name of its certificate (`swarm.bus.gate.Gate`).
    Either way a client that logs in with a username is held to the ACL of the swarm's topics
    under `prefix` (`Topics.may_publish`): the scheduler publishes anything, a peer (username =
    its peer id) only `peers/{peer}` and `jobs/+/load/{peer}`, its last-will included. With a
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
        broker = _AclBroker(config, gate=gate, limits=self.limits, mutual=mutual)
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
