"""Swarm tokens: one shared secret that every gRPC call must carry as `authorization: Bearer <t>`.

Server side, `server_interceptors(token, registry, refusals)` gives the `interceptors=` of a
`grpc.aio.server`: with a token, every call (unary or streaming) that lacks it or carries another
is refused with UNAUTHENTICATED before any handler runs; without one, nothing is installed and no
call pays for a check. The gRPC health service (`/grpc.health.v1.Health/`) stays open, so
liveness probes and readiness waits need no secret; it reveals only SERVING/NOT_SERVING.

Client side, `channel(address, token=...)` attaches the token to every call of every kind (a
client interceptor: call credentials would need a secure channel). The token travels in clear text
on an insecure channel: it keeps strangers' processes out of a swarm on a trusted network, not an
eavesdropper; with TLS (`swarm.net.tls`: `--tls-ca` ...) channels and ports are secure and the token
travels encrypted beside the certificates.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import logging
import os
from collections.abc import AsyncIterable, Awaitable, Callable, Hashable, Sequence
from typing import Any, Protocol

import grpc
from prometheus_client import CollectorRegistry, Counter

from swarm.errors import ConfigError, SwarmError
from swarm.net import paths, tls
from swarm.net.ports import Listener, bind_error, raise_if_taken
from swarm.net.relay_auth import relay_credential
from swarm.net.tls_mismatch import grpc_host_port

__all__ = [
    "HEALTH_PREFIX",
    "TOKEN_ENV",
    "RefusalLog",
    "TokenAuthInterceptor",
    "add_port",
    "channel",
    "refuse_open_host",
    "server_interceptors",
    "token_from_env",
]

log = logging.getLogger(__name__)

TOKEN_ENV = "SWARM_TOKEN"
HEALTH_PREFIX = "/grpc.health.v1.Health/"
_KEY = "authorization"
_SCHEME = "bearer "  # RFC 6750: the scheme is case-insensitive
_DRAIN_S = 1.0  # longest a refused streaming call is read before the answer (seconds)
_DRAIN_IDLE_S = 0.1  # a pause this long ends the read early (seconds)
_MAX_DRAINING = 2  # refused streaming calls read at once (a message each); past it, unread

Handler = Any  # grpc.RpcMethodHandler; its stubs lack the attributes read here


class RefusalLog(Protocol):
    """Where refusals are logged: a stranger can cause thousands a second, so a server passes a
    rated log (`swarm.ops.rated.RatedLog`, keyed by the refusal's reason)."""

    def warning(self, key: Hashable, msg: str, *args: object) -> object: ...


def token_from_env() -> str | None:
    """`SWARM_TOKEN`, or None when unset or blank."""
    token = os.environ.get(TOKEN_ENV, "").strip()
    return token or None


def refuse_open_host(what: str, host: str, *, token: str | None, insecure: bool) -> None:
    """ConfigError when `what` would listen on `host`, an address other machines reach (anything
    but loopback), without a token: every caller who reaches the port would be let in. Meant
    open (`--insecure-no-token`, a trusted network), it is not refused."""
    if token or insecure or host.strip("[]") == "localhost":
        return
    try:
        if ipaddress.ip_address(host.strip("[]")).is_loopback:
            return
    except ValueError:
        pass  # a host name, or "" (every interface): not known to stay on this machine
    raise ConfigError(
        f"{what} would listen on --host {host or repr(host)} without a token, open to every "
        "caller who reaches it: give --token-file PATH or SWARM_TOKEN (or --token), listen on "
        "127.0.0.1, or --insecure-no-token to run it open on a trusted network"
    )


def _problem(metadata: Sequence[tuple[str, str | bytes]] | None, expected: bytes) -> str | None:
    """What is wrong with the call's credentials, or None when right; `expected` is the token's
    sha256 digest."""
    values = [v for k, v in metadata or () if k == _KEY]
    if not values:
        return "no authorization metadata"
    if len(values) > 1:
        return "more than one authorization value"
    value = values[0] if isinstance(values[0], str) else values[0].decode("latin-1")
    if value[: len(_SCHEME)].lower() != _SCHEME:
        return "authorization is not a Bearer token"
    given = hashlib.sha256(value[len(_SCHEME) :].encode()).digest()
    if not hmac.compare_digest(given, expected):  # digests: equal lengths, so no length leak
        return "wrong token"
    return None


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without the swarm token (UNAUTHENTICATED) at their header, before a byte of
    their message is read; health checks pass.

    Counts every refusal in `swarm_auth_refused_total` on `registry` (one interceptor per
    registry); logs them on `refusals`, keyed by their reason (never the caller's address).
    """

    def __init__(
        self,
        token: str,
        registry: CollectorRegistry,
        refusals: RefusalLog,
        *,
        open_prefixes: Sequence[str] = (),
    ) -> None:
        if not token:
            raise ValueError("an empty token would let every call in; pass None to disable auth")
        self._expected = hashlib.sha256(token.encode()).digest()
        self._open = (HEALTH_PREFIX, *open_prefixes)
        self.refused = Counter(
            "swarm_auth_refused_total",
            "gRPC calls refused for a missing or wrong swarm token",
            registry=registry,
        )
        self._log = refusals
        self._draining = 0  # refused streaming calls being read before their answer

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        details: Any = handler_call_details
        method: str = details.method
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(self._open):
            return handler  # unknown methods answer UNIMPLEMENTED either way
        problem = _problem(details.invocation_metadata, self._expected)
        if problem is None:
            return handler
        self.refused.inc()
        return self._refusal(handler, method, problem)

    def _refusal(self, handler: Handler, method: str, problem: str) -> Handler:
        """A handler that only aborts; it logs the caller, which the interceptor itself cannot
        see (the context is handed to handlers only).

        Always of a streaming request kind, whatever `handler`'s: grpc-aio reads a unary call's
        whole message (up to the server's message limit, holding a call slot meanwhile) before
        it runs the handler, but hands a streaming one an iterator it need not touch. On the
        wire the kinds are alike, so a unary client gets its UNAUTHENTICATED just the same."""
        drain = bool(handler.request_streaming)

        async def refuse(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            self._log.warning(problem, "refused %s from %s: %s", method, context.peer(), problem)
            if drain and self._draining < _MAX_DRAINING:
                self._draining += 1
                try:
                    await _drain(requests)
                finally:
                    self._draining -= 1
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED, f"{problem}; this swarm needs its token"
            )

        make: Any = (
            grpc.stream_stream_rpc_method_handler
            if handler.response_streaming
            else grpc.stream_unary_rpc_method_handler
        )
        # No request deserializer: a refused caller's bytes are never parsed.
        return make(refuse, response_serializer=handler.response_serializer)


async def _drain(requests: AsyncIterable[Any]) -> None:
    """Read what a refused client is still sending, briefly, before answering. grpc-aio clients
    report a write that loses the race with the server's early close as INTERNAL ("Internal
    error from Core"), hiding UNAUTHENTICATED; a client that writes all, then reads (the data
    plane) thus gets the real reason. Bounded in time, and to `_MAX_DRAINING` calls at once (each
    may hold a message): past it a refused call is answered at once, so a flood of them holds
    neither the server's call slots nor its memory."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _DRAIN_S
    it = requests.__aiter__()
    while (left := deadline - loop.time()) > 0:
        try:
            # A client waiting for a reply mid-stream gets its answer after the idle time.
            await asyncio.wait_for(it.__anext__(), min(_DRAIN_IDLE_S, left))
        except (StopAsyncIteration, TimeoutError):
            return


def server_interceptors(
    token: str | None, registry: CollectorRegistry, refusals: RefusalLog
) -> list[grpc.aio.ServerInterceptor]:
    """The `interceptors=` for `grpc.aio.server`: a token check, or nothing without a token."""
    return [TokenAuthInterceptor(token, registry, refusals)] if token else []


class _Token:
    """Adds `authorization: Bearer <token>` to a call's metadata."""

    def __init__(self, token: str) -> None:
        self._pair = (_KEY, f"Bearer {token}")

    def _with_token(self, details: Any) -> Any:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._pair)
        return details._replace(metadata=metadata)


# One class per call kind: a channel files each interceptor under the first kind it matches.
class _UnaryUnary(_Token, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._with_token(details), request)


class _UnaryStream(_Token, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._with_token(details), request)


class _StreamUnary(_Token, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._with_token(details), requests)


class _StreamStream(_Token, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._with_token(details), requests)


# A peer that restarts at the same address is reached again within seconds: gRPC's own pauses
# between reconnects grow to two minutes, far longer than a stage server takes to come back.
_RECONNECT = (
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 5000),
)


def channel(
    address: str, *, token: str | None, options: Sequence[tuple[str, Any]] | None = None
) -> grpc.aio.Channel:
    """A `grpc.aio` channel that sends `token` with every call (none when None): over TLS with
    the process's identity (`swarm.net.tls`), else in clear text. A relayed address
    (`swarm.net.paths`) is dialled through its relay: an HTTP CONNECT to the peer's announced
    address, with the relay credential for that peer; TLS stays end to end, the peer's
    certificate checked against its announced host as on a direct dial."""
    interceptors = None
    if token:
        interceptors = [k(token) for k in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]
    path = paths.parse(address)
    given = {name for name, _ in options or ()}
    options = [*(options or ()), *((k, v) for k, v in _RECONNECT if k not in given)]
    if path.relay is not None and path.peer is not None:
        address = path.target
        password = relay_credential(token, path.peer)
        # Always "user:password" (an empty password without a token): a login without its colon
        # is no credentials at all to the relay, which would not know whom the call is for.
        login = f"{path.peer}:{password}"
        _warn_no_proxy(path.target)
        # Set per channel: a relayed channel never shares a connection with a direct one.
        options += [
            ("grpc.enable_http_proxy", 1),
            ("grpc.http_proxy", f"http://{login}@{path.relay}"),
        ]
    identity = tls.current()
    if identity is not None:
        return grpc.aio.secure_channel(
            address, identity.channel_credentials(), options=options, interceptors=interceptors
        )
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


_NO_PROXY = ("no_grpc_proxy", "no_proxy")  # what gRPC reads, in its order
_warned: set[str] = set()


def _warn_no_proxy(target: str) -> None:
    """gRPC dials the hosts `no_proxy` lists directly, whatever the channel's proxy: a relayed
    peer's announced host among them is dialled past its relay (and fails). Said once per host."""
    host = target.rpartition(":")[0].strip("[]")
    for name in _NO_PROXY:
        listed = os.environ.get(name, "")
        if not listed:
            continue
        if host not in _warned and any(
            entry == "*" or host == entry or host.endswith("." + entry.lstrip("."))
            for entry in (e.strip() for e in listed.split(","))
            if entry
        ):
            _warned.add(host)
            log.warning("%s lists %s: gRPC dials it directly, not through its relay; take it "
                        "out of %s", name, host, name)  # fmt: skip
        return  # gRPC reads the first one set


def add_port(server: grpc.aio.Server, address: str, what: str) -> int:
    """Listen on `address`, `host:port` (TLS with the process's identity, if any); the bound
    port. `PortInUse` when another process listens there, a `SwarmError` saying why for another
    failure."""
    identity = tls.current()
    try:
        if identity is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, identity.server_credentials(what))
    except RuntimeError:  # gRPC says only "failed to bind": the port is asked why
        bound = 0
    if bound:
        return bound
    where = grpc_host_port(address)
    why = bind_error(*where) if where else None
    if where is not None:
        raise_if_taken(why, *where, Listener.GRPC)
    raise SwarmError(f"{what} cannot listen on {address}" + (f": {why}" if why else ""))
