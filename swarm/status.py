"""The one mapping from swarm's errors to gRPC status codes, by ancestry (a subclass gets its
parent's code unless it has its own). Every servicer uses this."""

from __future__ import annotations

import grpc

from swarm.errors import (
    Aborted,
    ConfigError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)

__all__ = ["STATUS", "status_code"]

STATUS: dict[type[Exception], grpc.StatusCode] = {
    Aborted: grpc.StatusCode.ABORTED,
    ConfigError: grpc.StatusCode.INVALID_ARGUMENT,
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def status_code(error: BaseException) -> grpc.StatusCode | None:
    """The status for `error`, or None when it is not one of ours (a bug: answer INTERNAL)."""
    return next((STATUS[c] for c in type(error).__mro__ if c in STATUS), None)
