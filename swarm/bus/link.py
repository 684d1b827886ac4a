"""One MQTT connection of a `swarm.bus.connection.Bus`: how it is dialled (`Dialer`), the live
client with
the tasks that die with it (`Link`), and how a failed connect is told apart (refused credentials
are final) and cleaned up."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import ssl
from collections.abc import Callable, Coroutine
from typing import Any

import aiomqtt
from aiomqtt.exceptions import MqttConnectError
from google.protobuf.message import Message

from swarm.bus.api import BusAuthError, BusRefused, BusSettings, BusTlsMismatch
from swarm.bus.probe import answers_in_clear, not_a_broker
from swarm.bus.topics import BrokerAddress, check_topic
from swarm.deadline import cancel_kept
from swarm.net import tls as swarm_tls
from swarm.net.tls_mismatch import PROBE_TIMEOUT_S, Speaks, explain_verify, probe

__all__ = ["Dialer", "Link"]

# CONNACK refusals that retrying cannot fix (MQTT 3.1.1 codes and paho's MQTT 5 equivalents):
# a bad user name or password (4, 134), or not authorised (5, 135).
_AUTH_REFUSALS = {4, 5, 134, 135}
_BAD_PASSWORD = {4, 134}
# aiomqtt warns past this many publishes awaiting their PUBACK (its default: 10). The scheduler
# withdraws an ended job's assignments all at once, one retained publish per peer (up to
# `scheduler.peer_room`'s 16,384 peers), so many at once is a job's normal end, not a broker in
# trouble: a broker that does not confirm is said by each publish's own timeout.
PENDING_PUBLISHES_WARN = 1 << 15


@dataclasses.dataclass(frozen=True)
class Dialer:
    """Everything a fresh connection needs: address, login, last-will, TLS, timings."""

    address: BrokerAddress
    client_id: str
    settings: BusSettings
    username: str | None = None
    password: str | None = dataclasses.field(default=None, repr=False)
    will: aiomqtt.Will | None = None
    tls: ssl.SSLContext | None = None

    @classmethod
    def create(
        cls,
        address: BrokerAddress,
        client_id: str,
        settings: BusSettings,
        *,
        will: tuple[str, Message] | None = None,
        token: str | None = None,
        username: str | None = None,
        server_name: str | None = None,
    ) -> Dialer:
        """Log in as the URL's user, else as `username` (a peer: its peer id; the scheduler:
        "scheduler"), else as "swarm" (on Mosquitto, which makes a client's id its user, a
        trainer's URL names a user of its own: two connections of one user replace each other);
        with the URL's password, else `token` (a password of a peer's own, set in its URL, wins
        over the swarm token it needs for gRPC anyway). The broker's ACL lets a user publish only
        its own topics. `will` (topic, message) becomes a retained last-will. `server_name`: the
        name the broker's certificate must hold, when not the host dialled (the scheduler's own
        broker, dialled on this machine)."""
        login = address.username or username
        password = address.password if address.password is not None else token
        if password is not None:
            login = login or "swarm"
        last_will = None
        if will is not None:
            check_topic(will[0])
            last_will = aiomqtt.Will(will[0], will[1].SerializeToString(), qos=1, retain=True)
        # mqtts://: the swarm CA (and this process's certificate) when it has a TLS identity,
        # else the system's trusted CAs (a broker with a public certificate).
        identity = swarm_tls.current()
        tls = None
        if address.tls:
            tls = identity.client_context(server_name) if identity else ssl.create_default_context()
        return cls(address, client_id, settings, login, password, last_will, tls)

    async def connect(self) -> aiomqtt.Client:
        """A connected client; `BusRefused` when retrying cannot help (the broker refused the
        login: `BusAuthError`; TLS on one side only: `BusTlsMismatch`; a certificate refused by
        either side), else the error."""
        client = self.client()
        disarm = _fail_before_connack(client)
        try:
            await cancel_kept(client.__aenter__())
            return client
        except asyncio.CancelledError:
            # Cancelled as the CONNACK came (or before): the socket is as open as a failed one's.
            with contextlib.suppress(Exception):
                client._client.disconnect()
            raise
        except Exception as exc:
            rc = getattr(exc, "rc", None)
            code = getattr(rc, "value", rc)
            if isinstance(exc, MqttConnectError) and code in _AUTH_REFUSALS:
                raise BusAuthError(self._refusal(code, exc)) from exc
            # aiomqtt leaves the socket open when the CONNACK never came; close it so the late
            # CONNACK cannot revive a zombie session under our client id.
            with contextlib.suppress(Exception):
                client._client.disconnect()
            failure = exc
        finally:
            disarm()
        # The error (kept by the bus, logged) must not hold paho's: its traceback's frames hold
        # the TLS socket of a failed handshake, which paho never closes. So it is raised out of
        # the handler, with paho's error dropped.
        final = await self._final(str(failure))
        if final is not None:
            del failure
            raise final
        raise failure

    def _refusal(self, code: int, exc: Exception) -> str:
        """Why the broker refused the login, and what to check."""
        who = f"bus {self.client_id}: {self.address.url}"
        if self.username is None:
            return (
                f"{who} refused a login without user and password ({exc}): give the swarm "
                "token (--token, SWARM_TOKEN), or a user and password in the broker URL"
            )
        if code in _BAD_PASSWORD:
            return (
                f"{who} refused user {self.username!r}: bad user name or password ({exc}); "
                "check the token (--token, SWARM_TOKEN), or the password in the broker URL"
            )
        # Mosquitto answers "not authorised" both for a user its password file lacks and for
        # a wrong password: name both.
        return (
            f"{who} refused user {self.username!r}: not authorised ({exc}). Either the broker "
            f"does not know {self.username!r} (a peer logs in as its peer id, --peer; a trainer "
            "as its URL's user; Mosquitto's password file needs every one: `swarm broker-config "
            "--peers ID,... --trainers USER,...` writes it), or its password there is not the "
            "token (--token, SWARM_TOKEN) or the password in the broker URL"
        )

    async def _final(self, error: str) -> BusRefused | None:
        """The refusal a failed connect means, when retrying cannot help: a certificate that
        does not verify, TLS on one side only (a clear-text CONNECT to a TLS port is reset and
        waits out the CONNACK, a TLS handshake with a clear-text port is reset: the port is asked
        which it speaks), or a client certificate missing where the broker requires one."""
        who = f"bus {self.client_id}"
        host, port, identity = self.address.host, self.address.port, swarm_tls.current()
        at = f"the broker at {self.address.url}"
        if self.address.tls and (unverified := explain_verify(error, at, identity)):
            return BusRefused(f"{who}: {unverified}")
        timeout = min(PROBE_TIMEOUT_S, self.settings.operation_timeout_s)
        speaks = await asyncio.to_thread(probe, host, port, timeout)
        if speaks is not Speaks.NO_ANSWER:  # something listens: is it a broker?
            context = None if speaks is Speaks.PLAIN else _probe_context(identity)
            other = await asyncio.to_thread(not_a_broker, host, port, context, timeout)
            if other is not None:
                return BusRefused(f"{who}: {self.address.url} {other}")
        bracketed = f"[{host}]" if ":" in host else host
        if not self.address.tls and speaks in (Speaks.TLS, Speaks.TLS_CLIENT_CERT):
            return BusTlsMismatch(
                f"{who}: {at} speaks TLS: use mqtts://{bracketed}:{port}, keeping any "
                "user:password@ (and --tls-ca when its certificate is the swarm CA's"
                + (
                    "; --tls-cert and --tls-key: it requires a client certificate)"
                    if speaks is Speaks.TLS_CLIENT_CERT
                    else ")"
                )
            )
        # A clear-text broker may also say nothing to a TLS handshake (amqtt waits for the
        # rest of what it reads as a packet): asked in clear text, it answers.
        silent = speaks is Speaks.NO_ANSWER and self.address.tls
        if silent and await asyncio.to_thread(answers_in_clear, host, port, timeout):
            speaks = Speaks.PLAIN
        if self.address.tls and speaks is Speaks.PLAIN:
            return BusTlsMismatch(
                f"{who}: {at} does not speak TLS: use mqtt://{bracketed}:{port}, or give the "
                "broker a TLS listener"
            )
        if not self.address.tls or speaks is not Speaks.TLS_CLIENT_CERT:
            return None
        # Under TLS 1.3 the broker refuses a client certificate after the handshake: paho logs
        # the alert, and the connect just times out.
        if identity is None or identity.cert is None:
            return BusRefused(
                f"{who}: TLS refused: {at} requires a client certificate: give --tls-cert and "
                "--tls-key with one the swarm's CA issued (`swarm certs issue NAME`)"
            )
        if "alert" in error.lower():
            return BusRefused(
                f"{who}: TLS refused: {at} refused this process's certificate (--tls-cert "
                f"{identity.cert_path}): expired, or not from the CA it trusts"
            )
        return None

    def client(self) -> aiomqtt.Client:
        client = aiomqtt.Client(
            self.address.host,
            self.address.port,
            username=self.username,
            password=self.password,
            identifier=self.client_id,
            will=self.will,
            clean_session=True,  # subscriptions are restored by the bus itself
            keepalive=self.settings.keepalive_s,
            timeout=self.settings.operation_timeout_s,
            tls_context=self.tls,
            logger=_paho_log(),
        )
        client.pending_calls_threshold = PENDING_PUBLISHES_WARN
        return client


def _fail_before_connack(client: aiomqtt.Client) -> Callable[[], None]:
    """Make `client`'s connect fail as soon as the connection closes before the broker's CONNACK
    (aiomqtt waits out its timeout instead): the other side reset it, or answered what is not
    MQTT. Returns what ends this, once the connect is over."""
    paho, connecting = client._client, client._connected
    inner = paho.on_disconnect
    armed = [True]

    def on_disconnect(*args: Any) -> None:
        if inner is not None:
            inner(*args)
        if armed[0] and not connecting.done():
            reason = args[3] if len(args) > 3 else "closed"
            connecting.set_exception(
                aiomqtt.MqttError(f"the connection closed before the broker's CONNACK ({reason})")
            )

    paho.on_disconnect = on_disconnect

    def disarm() -> None:
        armed[0] = False
        paho.on_disconnect = inner

    return disarm


class _Explained(logging.Filter):
    """Paho's "Unrecognised command" line: a port that is not a broker's, which the dialer
    names in words (`swarm.bus.probe`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Error: Unrecognised command")


_EXPLAINED = _Explained()


def _paho_log() -> logging.Logger:
    """aiomqtt's logger ("mqtt"), less the lines the dialer says better."""
    logger = logging.getLogger("mqtt")
    logger.addFilter(_EXPLAINED)  # once: a filter already there is not added again
    return logger


def _probe_context(identity: swarm_tls.Tls | None) -> ssl.SSLContext:
    """TLS for asking a port what it is: verifying nothing (it is sent only a CONNECT), offering
    MQTT or HTTP/2, showing this process's certificate, if any, to a server that requires one."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    # A gRPC server closes a TLS connection that does not offer HTTP/2 without a word.
    context.set_alpn_protocols(["mqtt", "h2"])
    if identity is not None and identity.cert_path is not None and identity.key_path is not None:
        context.load_cert_chain(identity.cert_path, identity.key_path)
    return context


class Link:
    """One live MQTT connection and the tasks (SUBSCRIBE calls, the reader) that die with it."""

    def __init__(self, client: aiomqtt.Client) -> None:
        self.client = client
        self.failed: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
        self.closed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    def fail(self, exc: BaseException) -> None:
        if not self.failed.done():
            self.failed.set_result(exc)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(self._guard(coro))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def drain(self, keep: asyncio.Task[None], timeout: float) -> None:
        """Wait (bounded) for the calls in flight, all but `keep`."""
        pending = [t for t in self._tasks if t is not keep]
        if pending:
            await asyncio.wait(pending, timeout=timeout)

    async def _guard(self, coro: Coroutine[Any, Any, None]) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure on this link is healed by reconnecting
            self.fail(exc)

    async def aclose(self) -> None:
        self.closed.set()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
