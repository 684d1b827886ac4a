"""amqtt's broker, made the swarm's: `AclBroker` checks every CONNECT with the `Gate` before amqtt
touches a session, holds publishing and retaining to the ACL and the retained budget, bounds each
subscriber's queue (`swarm.bus.outbox`) and counts every connection from its first byte, TLS
handshake included. `swarm.bus.broker.EmbeddedBroker` configures and runs it.

The hooks are amqtt's private methods (pinned amqtt version; tests/swarm/bus/ drive each through
a real broker, so a version that moved one fails them).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import ssl
from collections.abc import Iterator
from typing import Any, NoReturn

from amqtt.adapters import ReaderAdapter, StreamReaderAdapter, WriterAdapter
from amqtt.broker import Broker
from amqtt.contexts import Action, BrokerConfig, ListenerConfig, ListenerType
from amqtt.errors import AMQTTError, MQTTError, NoDataError
from amqtt.mqtt.connack import ConnackPacket
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
from amqtt.session import Session
from amqtt.utils import gen_client_id
from google.protobuf.message import DecodeError

from swarm.bus.bounds import check_size
from swarm.bus.gate import Gate, Refusal
from swarm.bus.limits import BrokerLimits, PacketCap, PacketTooLarge
from swarm.bus.outbox import AbortableWriter, BoundedHandler, Outboxes
from swarm.bus.retained_budget import RetainedBudget
from swarm.bus.topics import SCHEDULER_USER, TopicError
from swarm.net.addresses import host_port
from swarm.ops.rated import RatedLog

__all__ = ["DISCONNECT_GRACE_S", "AclBroker"]

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


class AclBroker(Broker):
    """amqtt's broker behind the swarm's `Gate`: every CONNECT is checked before amqtt touches a
    session, a last-will passes the ACL again when it is sent, and a PUBLISH the ACL refuses is
    dropped (MQTT 3.1.1 has no way to say no) and logged, as is a retained message where the
    swarm retains nothing or past its user's budget; subscribing is open, receiving too except
    another peer's reachability report (`Gate.may_read`), each subscriber's queue bounded. Under
    TLS a connection is counted from its first byte, and its handshake bounded by the connect
    timeout (asyncio's listener counted it only once done).

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
        self._open = 0  # connections held, logged in or not, handshake done or not
        self._tls: dict[str, ssl.SSLContext] = {}  # listener -> its context, for the handshake
        self._rated = RatedLog(log)  # one line per kind of refusal a stranger can repeat
        self._outboxes = Outboxes(limits)
        self._budget = RetainedBudget(limits.max_retained_bytes_per_user, limits.max_retained_bytes)
        self._subscriptions = _Snapshots(self._subscriptions)  # type: ignore[has-type]

    async def _create_server_instance(
        self,
        listener_name: str,
        listener_type: ListenerType,
        address: str | None,
        port: int,
        ssl_context: ssl.SSLContext | None,
    ) -> Any:
        # amqtt's, in clear text: the TLS handshake is `stream_connected`'s, once the connection
        # is counted (asyncio's TLS listener hands over a connection only after its handshake,
        # so silent ones were held uncounted until they took every descriptor).
        if listener_type != ListenerType.TCP:
            return await super()._create_server_instance(
                listener_name, listener_type, address, port, ssl_context
            )
        if ssl_context is not None:
            self._tls[listener_name] = ssl_context
        return await asyncio.start_server(
            functools.partial(self.stream_connected, listener_name=listener_name),
            address,
            port,
            reuse_address=True,
        )

    async def stream_connected(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, listener_name: str
    ) -> None:
        if self._open >= self._limits.max_connections:
            self._rated.warning(
                "full",
                "broker: closed a new connection: %d held already, the limit "
                "(limits.max_connections=%d)",
                self._open,
                self._limits.max_connections,
            )
            writer.transport.abort()
            return
        self._open += 1
        out = AbortableWriter(writer)
        box = self._outboxes.open(f"a connection from {_peer(writer)}", out.abort)
        out.outbox = box
        out.deadline = asyncio.get_running_loop().time() + self._limits.connect_timeout_s
        try:
            if await self._handshake(writer, listener_name, out.deadline):
                capped = PacketCap(StreamReaderAdapter(reader), self._limits.max_packet_bytes)
                await self._client_connected(listener_name, capped, out)
        except asyncio.CancelledError:
            # The broker stops with this connection still open (a client not logged in yet):
            # the connection ends here. Raised on, Python 3.11's stream callback reads the
            # cancelled task's exception() and logs an `ERROR asyncio` traceback at every
            # clean shutdown; nothing awaits this task.
            writer.transport.abort()
        finally:
            self._open -= 1
            self._gate.release(asyncio.current_task())
            self._outboxes.discard(box)
            # amqtt ends some sessions (a client gone mid-session) without closing its side: the
            # socket stayed open until garbage collection, which warned in whatever ran then.
            # (Closed, not aborted: whatever amqtt wrote last, a refusing CONNACK, still goes.)
            if not writer.transport.is_closing():
                writer.close()

    async def _handshake(
        self, writer: asyncio.StreamWriter, listener_name: str, deadline: float
    ) -> bool:
        """The TLS handshake of a listener with TLS, by `deadline`; False (closed) on failure."""
        context = self._tls.get(listener_name)
        if context is None:
            return True
        try:
            async with asyncio.timeout_at(deadline):
                await writer.start_tls(
                    context, ssl_handshake_timeout=self._limits.connect_timeout_s
                )
        except (TimeoutError, OSError, ssl.SSLError) as exc:
            self._rated.info(
                "handshake",
                "broker: closed %s: no TLS handshake within %.1f s (limits.connect_timeout_s): %s",
                _peer(writer),
                self._limits.connect_timeout_s,
                exc or type(exc).__name__,
            )
            writer.transport.abort()
            return False
        return True

    def _create_ssl_context(self, listener: ListenerConfig) -> ssl.SSLContext:  # type: ignore[override]
        context = Broker._create_ssl_context(listener)
        if self._mutual:  # amqtt asks for a client certificate but lets one without it in
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    async def _initialize_client_session(
        self, reader: ReaderAdapter, writer: WriterAdapter, remote_address: str, remote_port: int
    ) -> tuple[BrokerProtocolHandler, Session]:
        # amqtt's own deletes or takes over the CONNECT's client id before authenticating; this
        # one reads the CONNECT, asks the gate, and only then touches the sessions.
        where = host_port(remote_address, remote_port)
        handler, session = await self._read_connect(reader, writer, where)
        refusal = self._gate.admit(session)
        if refusal is not None:
            await self._refuse(session, refusal, writer, where)
        if not session.client_id:
            session.client_id = gen_client_id()
        self._gate.claim(session, asyncio.current_task())  # released when this connection ends
        if isinstance(handler, BoundedHandler):
            self._bound(handler, session, writer)
        await self._take_over(session)
        session.parent = 0
        if session.keep_alive > 0:
            session.keep_alive += DISCONNECT_GRACE_S
        return handler, session

    async def _read_connect(
        self, reader: ReaderAdapter, writer: WriterAdapter, where: str
    ) -> tuple[BrokerProtocolHandler, Session]:
        """The client's CONNECT, read within `limits.connect_timeout_s` of its first byte; a
        silent, oversized or malformed one closes the connection, said (rated) with its cause."""
        timeout_s = self._limits.connect_timeout_s
        deadline = getattr(writer, "deadline", None)  # its first byte's, under TLS as well
        if deadline is None:
            deadline = asyncio.get_running_loop().time() + timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                return await BoundedHandler.init_from_connect(reader, writer, self.plugins_manager)
        except TimeoutError:
            self._rated.info(
                "silent",
                "broker: closed %s: no CONNECT within %.1f s (limits.connect_timeout_s)",
                where,
                timeout_s,
            )
            await _close(writer)
            raise AMQTTError(f"no CONNECT within {timeout_s} s") from None
        except PacketTooLarge as exc:  # in the CONNECT: made an error amqtt's caller handles
            self._rated.warning("large", "broker: closed %s: %s", where, exc)
            await _close(writer)
            raise MQTTError(str(exc)) from exc
        except (AMQTTError, MQTTError, NoDataError) as exc:
            # Said here, rated (amqtt's own line for it is held back: `swarm.bus.amqtt_log`).
            self._rated.warning(
                ("malformed", type(exc).__name__),
                "broker: closed %s: no valid CONNECT: %s",
                where,
                exc or type(exc).__name__,
            )
            await _close(writer)
            raise

    async def _refuse(
        self, session: Session, refusal: Refusal, writer: WriterAdapter, where: str
    ) -> NoReturn:
        """Answer the gate's refusal (a CONNACK with its code), close, and raise."""
        # `swarm`'s broker probe (`swarm.bus.probe`) sends a CONNECT with no client id (amqtt
        # makes one up, "amqtt/...") nor login, to learn that a broker answers: refused here,
        # and no news.
        made_up = (session.client_id or "amqtt/").startswith("amqtt/")
        probe = made_up and not (session.username or session.password)
        self._rated.log(
            logging.INFO if probe else logging.WARNING,
            ("login", refusal.code, probe),
            "broker: refused client %r (user %r) from %s: %s%s",
            session.client_id,
            session.username,
            where,
            refusal.reason,
            " (a CONNECT without client id or login: a broker probe?)" if probe else "",
        )
        with contextlib.suppress(Exception):
            await ConnackPacket.build(0, refusal.code).to_stream(writer)
        await _close(writer)
        raise MQTTError(f"refused: {refusal.reason}")

    def _bound(self, handler: BoundedHandler, session: Session, writer: WriterAdapter) -> None:
        """The connection's bounds: it reads only while its user may (the gate's quotas), and
        sends through the writer's outbox, named for its client in what the outbox says."""
        handler.readable = functools.partial(self._gate.may_read, session.username)
        box = getattr(writer, "outbox", None)
        if box is not None:
            box.name = f"client {session.client_id!r} (user {session.username!r})"
            handler.outbox = box

    async def _take_over(self, session: Session) -> None:
        """The client id's session, admitted: its old connection, if still connected, closed
        (the gate refused any other user, so it is the same user again), its old session gone."""
        held = self._sessions.get(session.client_id)
        if held is not None and held[0].transitions.is_connected():
            # Drop the old connection, as MQTT says, rather than leave it connected without its
            # subscriptions.
            log.info("broker: client %r again; closing its old connection", session.client_id)
            await held[1].handle_connection_closed()
            await held[1].stop()
        await self._delete_session(session.client_id)

    async def _authenticate(self, session: Session, _: ListenerConfig) -> bool:
        return self._gate.admit(session) is None  # checked again, had amqtt moved the hook

    async def _handle_disconnect(
        self, client_session: Session, handler: BrokerProtocolHandler, disconnect_waiter: Any
    ) -> None:
        user, topic = client_session.username, client_session.will_topic or ""
        why = None
        if client_session.will_flag and not self._gate.may_publish(user, topic):
            why = "not its topic"
        elif client_session.will_flag and (
            oversized := _oversized(self._gate, topic, client_session.will_message)
        ):
            why = oversized  # every reader drops it, as a message published so
        elif client_session.will_flag and client_session.will_retain:
            why = self._retain_refusal(user, topic, len(client_session.will_message or b""))
        if why is not None:
            self._rated.warning(
                "will", "broker: dropped the last-will of user %r on %r: %s", user, topic, why
            )
            client_session.will_flag = False
        await super()._handle_disconnect(client_session, handler, disconnect_waiter)

    def _counted(self, user: str | None) -> str | None:
        """Whose budget `user`'s retained messages are (`RetainedBudget`): None for the
        scheduler, and for a client without a username on an open broker (trusted)."""
        if user == SCHEDULER_USER or (not user and not self._gate.closed):
            return None
        return user or ""

    def _retain_refusal(self, user: str | None, topic: str, size: int) -> str | None:
        if not self._gate.may_retain(user, topic):
            return "a peer retains only its announcement (peers/{peer})"
        return self._budget.refusal(self._counted(user), topic, size)

    async def _handle_message_delivery(
        self, client_session: Session, handler: BrokerProtocolHandler, wait_deliver: Any
    ) -> bool:
        # A retained message the swarm does not retain, or past its user's budget, is dropped
        # whole: delivered without its retain flag it would not be what its sender meant.
        message = wait_deliver.result()
        if message.topic and (why := _oversized(self._gate, message.topic, message.data)):
            # Every reader drops it (`swarm.bus.bounds`): sent on, it would sit in each
            # subscriber's outbox first, and past their total close the one holding the most.
            self._rated.warning(
                "oversized",
                "broker: dropped a message from user %r on %r: %s",
                client_session.username,
                message.topic[:200],
                why,
            )
            return True
        packet = getattr(message, "publish_packet", None)
        if packet is not None and packet.retain_flag and message.topic:
            user = client_session.username
            if self._gate.may_publish(user, message.topic):  # else the ACL's drop, below
                why = self._retain_refusal(user, message.topic, len(message.data or b""))
                if why is not None:
                    self._rated.warning(
                        "retain",
                        "broker: dropped a retained message from user %r on %r: %s",
                        user,
                        message.topic,
                        why,
                    )
                    return True
        return await super()._handle_message_delivery(client_session, handler, wait_deliver)

    async def retain_message(
        self,
        source_session: Session | None,
        topic_name: str | None,
        data: bytes | bytearray | None,
        qos: int | None = None,
    ) -> None:
        if topic_name is not None:
            user = self._counted(source_session.username) if source_session else None
            size = len(data or b"")
            why = self._budget.refusal(user, topic_name, size)  # checked again: concurrent ones
            if why is not None:
                self._rated.warning(
                    "retain", "broker: not retained on %r, from user %r: %s", topic_name, user, why
                )
                return
            self._budget.stored(user, topic_name, size)
        await super().retain_message(source_session, topic_name, data, qos)

    async def _topic_filtering(self, session: Session, topic: str, action: Action) -> bool:
        if action != Action.PUBLISH:
            return True
        user = session.username if session is not None else None
        if self._gate.may_publish(user, topic or ""):
            return True
        self._rated.warning(
            "acl", "broker: dropped a message from user %r on %r: not its topic", user, topic
        )
        return False


def _peer(writer: asyncio.StreamWriter) -> str:
    """The remote address of `writer`'s connection, for log lines."""
    peer = writer.get_extra_info("peername")
    return host_port(peer[0], peer[1]) if peer and len(peer) >= 2 else "an unknown address"


def _oversized(gate: Gate, topic: str, data: bytes | bytearray | None) -> str | None:
    """Why a message on `topic` is past what every reader takes from a peer, if it is."""
    try:
        check_size(gate.topics.parse(topic), data or b"")
    except DecodeError as e:
        return str(e)
    except TopicError:
        return None  # not one of the swarm's topics: the ACL's to judge
    return None
