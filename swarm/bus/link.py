"""One MQTT connection of a `swarm.bus.connection.Bus`: how it is dialled (`Dialer`), the live
client with
the tasks that die with it (`Link`), and how a failed connect is told apart (refused credentials
are final) and cleaned up."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ssl
from collections.abc import Coroutine
from typing import Any

import aiomqtt
from aiomqtt.exceptions import MqttConnectError
from google.protobuf.message import Message

from swarm.bus.api import BusAuthError, BusSettings
from swarm.bus.topics import BrokerAddress, check_topic
from swarm.net import tls as swarm_tls

__all__ = ["Dialer", "Link"]

# CONNACK refusals that retrying cannot fix (MQTT 3.1.1 codes and paho's MQTT 5 equivalents).
_AUTH_REFUSALS = {4, 5, 134, 135}


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
    ) -> Dialer:
        """Log in as the URL's user, else as `username` (a peer: its peer id; the scheduler:
        "scheduler"), else as "swarm"; with the URL's password, else `token` (a password of a
        peer's own, set in its URL, wins over the swarm token it needs for gRPC anyway). The
        broker's ACL lets a user publish only its own topics. `will` (topic, message) becomes a
        retained last-will."""
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
            tls = identity.client_context() if identity else ssl.create_default_context()
        return cls(address, client_id, settings, login, password, last_will, tls)

    async def connect(self) -> aiomqtt.Client:
        """A connected client; `BusAuthError` when the broker refused the credentials (final),
        else the error (worth retrying)."""
        client = self.client()
        try:
            await client.__aenter__()
        except Exception as exc:
            rc = getattr(exc, "rc", None)
            if isinstance(exc, MqttConnectError) and getattr(rc, "value", rc) in _AUTH_REFUSALS:
                raise BusAuthError(
                    f"bus {self.client_id}: {self.address.url} refused the credentials "
                    f"({exc}); check the token, or the password in the broker URL"
                ) from exc
            # aiomqtt leaves the socket open when the CONNACK never came; close it so the late
            # CONNACK cannot revive a zombie session under our client id.
            with contextlib.suppress(Exception):
                client._client.disconnect()
            raise
        return client

    def client(self) -> aiomqtt.Client:
        return aiomqtt.Client(
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
        )


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
