"""Swarm tokens: one shared secret that every gRPC call must carry as `authorization: Bearer <t>`.

Server side, `server_interceptors(token, registry, refusals)` gives the `interceptors=` of a
`grpc.aio.server`: with a token, every call (unary or streaming) that lacks it or carries another
is refused with UNAUTHENTICATED before any handler runs; without one, nothing is installed and no
call pays for a check. The gRPC health service (`/grpc.health.v1.Health/`) stays open, so
liveness probes and readiness waits need no secret; it reveals only SERVING/NOT_SERVING.

Client side, the one dialer (`swarm.net.dial.channel`) attaches the token to every call. The
token travels in clear text on an insecure channel: it keeps strangers' processes out of a swarm
on a trusted network, not an eavesdropper; with TLS (`swarm.net.tls`: `--tls-ca` ...) channels
and ports are secure and the token travels encrypted beside the certificates.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any, Protocol

import grpc
from prometheus_client import CollectorRegistry, Counter

from swarm.errors import ConfigError, SwarmError
from swarm.net import tls, told_ahead
from swarm.net.ports import Listener, bind_error, raise_if_taken
from swarm.net.refused_streams import RefusedStreams
from swarm.net.tls_mismatch import grpc_host_port

__all__ = [
    "HEALTH_PREFIX",
    "TOKEN_ENV",
    "TOKEN_KEY",
    "RefusalLog",
    "TokenAuthInterceptor",
    "add_port",
    "refuse_open_host",
    "server_interceptors",
    "token_from_env",
]

TOKEN_ENV = "SWARM_TOKEN"
HEALTH_PREFIX = "/grpc.health.v1.Health/"
TOKEN_KEY = "authorization"  # the metadata key a call carries its token under
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
    values = [v for k, v in metadata or () if k == TOKEN_KEY]
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
        # Refused streams are read before their answer (`swarm.net.refused_streams`). Briefly:
        # a stranger's flood of them holds neither the server's call slots nor its memory; a
        # client waiting for a reply mid-stream gets its answer after the idle pause.
        self._refused_streams = RefusedStreams(
            total_s=_DRAIN_S, idle_s=_DRAIN_IDLE_S, at_once=_MAX_DRAINING
        )

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
            if drain:
                await self._refused_streams.drain(requests)
            # Told ahead too: a stream past the reads is answered unread (`told_ahead`).
            await told_ahead.refuse(
                context, grpc.StatusCode.UNAUTHENTICATED, f"{problem}; this swarm needs its token"
            )

        make: Any = (
            grpc.stream_stream_rpc_method_handler
            if handler.response_streaming
            else grpc.stream_unary_rpc_method_handler
        )
        # No request deserializer: a refused caller's bytes are never parsed.
        return make(refuse, response_serializer=handler.response_serializer)


def server_interceptors(
    token: str | None, registry: CollectorRegistry, refusals: RefusalLog
) -> list[grpc.aio.ServerInterceptor]:
    """The `interceptors=` for `grpc.aio.server`: a token check, or nothing without a token."""
    return [TokenAuthInterceptor(token, registry, refusals)] if token else []


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
