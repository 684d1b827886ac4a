"""The one dialer: `channel(address, token=...)`, the `grpc.aio` channel every call to a swarm
process goes over (a peer, the scheduler's job API, an aggregator), whoever makes it.

It attaches the swarm token (`swarm.net.tokens`) to every call of every kind (a client
interceptor: call credentials would need a secure channel), dials over TLS with the process's
identity when it has one (`swarm.net.tls`), reconnects within seconds to a peer that restarts,
and reaches a peer behind NAT through its relay when its address says so (`swarm.net.paths`):
an HTTP CONNECT to the peer's announced address, the one `swarm.relay.server` carries; or past
the relay, at that address, for a caller on the peer's LAN (`swarm.rpc.lan` decides).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import grpc

from swarm.net import paths, tls
from swarm.net.tokens import TOKEN_KEY

__all__ = ["CONNECT_ATTEMPT_MS", "channel"]

log = logging.getLogger(__name__)


class _Token:
    """Adds `authorization: Bearer <token>` to a call's metadata."""

    def __init__(self, token: str) -> None:
        self._pair = (TOKEN_KEY, f"Bearer {token}")

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


#: The least time a connection attempt is given to be answered (its TCP connect, TLS handshake
#: and the server's HTTP/2 SETTINGS), in ms: gRPC's own default. A call's deadline bounds it.
CONNECT_ATTEMPT_MS = 20_000

# A peer that restarts at the same address is reached again within seconds: gRPC's own pauses
# between reconnects grow to two minutes, far longer than a stage server takes to come back.
# gRPC reads `grpc.min_reconnect_backoff_ms` not as a pause but as the least time an attempt
# is given (its "min connect timeout"): at 250 ms, a server slower to answer a new connection
# (a loaded machine, TLS across an ocean, a relayed path) was taken for unreachable, and every
# call waiting on the channel failed UNAVAILABLE ("connection attempt timed out before
# receiving SETTINGS frame").
_RECONNECT = (
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", CONNECT_ATTEMPT_MS),
    ("grpc.max_reconnect_backoff_ms", 5000),
)


def channel(
    address: str,
    *,
    token: str | None,
    options: Sequence[tuple[str, Any]] | None = None,
    direct: bool = False,
) -> grpc.aio.Channel:
    """A `grpc.aio` channel that sends `token` with every call (none when None): over TLS with
    the process's identity (`swarm.net.tls`), else in clear text. A relayed address
    (`swarm.net.paths`) is dialled through its relay: an HTTP CONNECT to the peer's announced
    address, with the relay credential for that peer; TLS stays end to end, the peer's
    certificate checked against its identity (`paths.peer_name`: `PEER.peer.swarm`), not its
    announced host, which is private or loopback behind NAT and names nobody. `direct`: a
    relayed address dialled at its announced address, past its relay (a caller on the peer's
    LAN, `swarm.rpc.lan`), its certificate checked exactly as through the relay: by its id."""
    interceptors = None
    if token:
        interceptors = [k(token) for k in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]
    path = paths.parse(address)
    given = {name for name, _ in options or ()}
    options = [*(options or ()), *((k, v) for k, v in _RECONNECT if k not in given)]
    if path.relay is not None:
        # How the peer is named and verified belongs here, alike on both paths; only the proxy
        # below is the relay's, and a direct dial (a caller on the peer's LAN) leaves it out.
        address = path.target
        if path.peer is not None:
            # Verified by its id: its announced host (192.168.1.10, 127.0.0.1) is another
            # peer's too, in another home.
            options += [("grpc.ssl_target_name_override", paths.peer_name(path.peer))]
    if path.relay is not None and path.peer is not None and not direct:
        password = paths.relay_credential(token, path.peer)
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
            log.warning(
                "%s lists %s: gRPC dials it directly, not through its relay; take it out of %s",
                name,
                host,
                name,
            )
        return  # gRPC reads the first one set
