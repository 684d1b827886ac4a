"""The one mapping between swarm's errors and gRPC status codes, both ways.

Servers: `status_code` by ancestry (a subclass gets its parent's code unless it has its own), and
`error_metadata` names the exact class in the trailing metadata. Clients: `from_rpc_error` turns
a failed call back into that class (or the class its status code means), so callers catch
`swarm.errors` and never read a status's details."""

from __future__ import annotations

import grpc

from swarm.errors import (
    Aborted,
    ActivationsNotCached,
    ConfigError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PeerUnavailable,
    RemoteError,
    ResourceExhausted,
    SwarmError,
)

__all__ = ["ERROR_KEY", "STATUS", "error_metadata", "from_rpc_error", "status_code"]

STATUS: dict[type[Exception], grpc.StatusCode] = {
    Aborted: grpc.StatusCode.ABORTED,
    ConfigError: grpc.StatusCode.INVALID_ARGUMENT,
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
}
# Trailing-metadata key naming the exact error class, for errors that share a status code.
ERROR_KEY = "swarm-error"
# Classes a client may rebuild from `ERROR_KEY` (a peer cannot make us raise anything else).
_BY_NAME: dict[str, type[SwarmError]] = {
    c.__name__: c
    for c in (
        ActivationsNotCached,
        Aborted,
        ConfigError,
        FailedPrecondition,
        InvalidArgument,
        NotFound,
        ResourceExhausted,
    )
}
_BY_CODE: dict[grpc.StatusCode, type[SwarmError]] = {
    grpc.StatusCode.ABORTED: Aborted,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: PeerUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: PeerUnavailable,
    grpc.StatusCode.CANCELLED: PeerUnavailable,
}


def status_code(error: BaseException) -> grpc.StatusCode | None:
    """The status for `error`, or None when it is not one of ours (a bug: answer INTERNAL)."""
    return next((STATUS[c] for c in type(error).__mro__ if c in STATUS), None)


def error_metadata(error: BaseException) -> tuple[tuple[str, str], ...]:
    """Trailing metadata that names `error`'s class, for `from_rpc_error` on the other side."""
    name = type(error).__name__
    return ((ERROR_KEY, name),) if name in _BY_NAME else ()


def from_rpc_error(error: grpc.RpcError) -> SwarmError:
    """The swarm error a failed call means; raise it `from` the gRPC error."""
    code: grpc.StatusCode = error.code()  # type: ignore[attr-defined]
    details = error.details() or code.name  # type: ignore[attr-defined]
    trailing = error.trailing_metadata() or ()  # type: ignore[attr-defined]
    name = next((str(v) for k, v in trailing if k == ERROR_KEY), None)
    cls = _BY_NAME.get(name or "") or _BY_CODE.get(code)
    if cls is None:
        return RemoteError(f"{code.name}: {details}", code.name)
    if cls is PeerUnavailable:
        return PeerUnavailable(f"{code.name}: {details}")
    return cls(details)
