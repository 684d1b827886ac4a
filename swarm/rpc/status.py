"""The one mapping between swarm's errors and gRPC status codes, both ways.

Servers: `status_code` by ancestry (a subclass gets its parent's code unless it has its own), and
`error_metadata` names the exact class in the trailing metadata, and an aborted round's `missing`
members. Clients: `from_rpc_error` turns a failed call back into that class (or the class its
status code means) with those members, so callers catch `swarm.errors` and never read a status's
details."""

from __future__ import annotations

import re

import grpc

from swarm.errors import (
    Aborted,
    ActivationsNotCached,
    Busy,
    ConfigError,
    DeadlineExceeded,
    FailedPrecondition,
    HandoverRefused,
    InvalidArgument,
    NonFiniteGradient,
    NotFound,
    PeerUnavailable,
    PermissionDenied,
    RemoteError,
    ResourceExhausted,
    SwarmError,
    Unauthenticated,
)
from swarm.net import tls
from swarm.net.told_ahead import told

__all__ = [
    "ERROR_KEY",
    "MISSING_KEY",
    "STATUS",
    "error_metadata",
    "from_rpc_error",
    "status_code",
]

STATUS: dict[type[Exception], grpc.StatusCode] = {
    Aborted: grpc.StatusCode.ABORTED,
    ConfigError: grpc.StatusCode.INVALID_ARGUMENT,
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    # A push whose next stage did not answer: this replica answers as that peer did not.
    PeerUnavailable: grpc.StatusCode.UNAVAILABLE,
    # A caller that did not send its request's body within the server's limit.
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
}
# Trailing-metadata key naming the exact error class, for errors that share a status code.
ERROR_KEY = "swarm-error"
# Trailing-metadata key of an `Aborted` round's `missing` members: group indices, "1,3".
MISSING_KEY = "swarm-missing"
_MISSING_RE = re.compile(r"\d{1,6}(,\d{1,6}){0,4095}", re.ASCII)  # anything else: not believed
# Classes a client may rebuild from `ERROR_KEY` (a peer cannot make us raise anything else).
_BY_NAME: dict[str, type[SwarmError]] = {
    c.__name__: c
    for c in (
        ActivationsNotCached,
        Aborted,
        Busy,
        ConfigError,
        FailedPrecondition,
        HandoverRefused,
        InvalidArgument,
        NonFiniteGradient,
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
    """Trailing metadata that names `error`'s class (and an aborted round's missing members),
    for `from_rpc_error` on the other side."""
    name = type(error).__name__
    metadata = [(ERROR_KEY, name)] if _BY_NAME.get(name) is type(error) else []
    if isinstance(error, Aborted) and error.missing:
        metadata.append((MISSING_KEY, ",".join(str(i) for i in error.missing)))
    return tuple(metadata)


def _missing(value: str | bytes | None) -> tuple[int, ...]:
    """`MISSING_KEY`'s indices; nothing when a peer sent something else."""
    text = value.decode(errors="replace") if isinstance(value, bytes) else value or ""
    if not _MISSING_RE.fullmatch(text):
        return ()
    return tuple(dict.fromkeys(int(i) for i in text.split(",")))


def from_rpc_error(error: grpc.RpcError) -> SwarmError:
    """The swarm error a failed call means; raise it `from` the gRPC error. A refusal whose
    status a grpc-aio write overwrote is read from what the server told ahead
    (`swarm.net.told_ahead`)."""
    error = told(error)
    code: grpc.StatusCode = error.code()  # type: ignore[attr-defined]
    details = error.details() or code.name  # type: ignore[attr-defined]
    trailing = error.trailing_metadata() or ()  # type: ignore[attr-defined]
    name = next((str(v) for k, v in trailing if k == ERROR_KEY), None)
    cls = _BY_NAME.get(name or "") or _BY_CODE.get(code)
    if cls is None:
        return RemoteError(f"{code.name}: {details}", code.name)
    if cls is PeerUnavailable:
        if code == grpc.StatusCode.UNAVAILABLE and tls.count_refusal(details):
            return PeerUnavailable(f"{code.name}: TLS refused: {details}")
        return PeerUnavailable(f"{code.name}: {details}")
    if issubclass(cls, Aborted):
        return cls(details, _missing(next((v for k, v in trailing if k == MISSING_KEY), None)))
    return cls(details)
