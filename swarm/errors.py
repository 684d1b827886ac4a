"""The exception hierarchy. Third-party errors are converted to these at the boundary: servicers map
them to gRPC status codes, and clients map a call's status back to them, in one place
(`swarm.rpc.status`)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "Aborted",
    "ActivationsNotCached",
    "BadReply",
    "Busy",
    "ConfigError",
    "DeadlineExceeded",
    "FailedPrecondition",
    "HandoverRefused",
    "InvalidArgument",
    "NonFiniteGradient",
    "NotFound",
    "PeerUnavailable",
    "PermissionDenied",
    "RemoteError",
    "ResourceExhausted",
    "SwarmError",
    "Unauthenticated",
    "WireError",
]


class SwarmError(Exception):
    """Base of every error swarm raises on purpose."""


class ConfigError(SwarmError, ValueError):
    """A job file or setting is wrong; the message names the key and what is allowed."""


class WireError(SwarmError):
    """A request or response that cannot be accepted; subclasses say which gRPC status fits."""


class InvalidArgument(WireError):
    """Malformed input: wrong shape, dtype, codec, or bytes that do not match the header."""


class NotFound(WireError):
    """Unknown job, stage or microbatch."""


class FailedPrecondition(WireError):
    """Valid, but not now: a stale step, or a commit without the receipts it names."""


class Aborted(FailedPrecondition):
    """A coordinated round could not complete (a peer missing or gone); retry under a new one.
    `missing`: the round's members it failed on, as indices into its group (a part that never
    came, a member that could not be reached); empty when it cannot tell. It crosses the wire in
    the trailing metadata (`swarm.rpc.status`), so the coordinator can leave the culprit out."""

    def __init__(self, message: str = "", missing: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.missing = tuple(missing)


class ActivationsNotCached(FailedPrecondition):
    """A Backward without inputs reached a replica that no longer caches the forward's
    activations: send it again with the inputs (the replica then recomputes)."""

    PREFIX = "activations not cached"


class HandoverRefused(FailedPrecondition):
    """A co-located replica could not take the tensor handed over to it (`swarm.device.handover`):
    a handle it cannot open, one of another device, memory gone. It took nothing: the caller
    sends the same call again with the bytes on the wire, to the same replica, which is not at
    fault (`stage_server.replica.next_hop`)."""

    PREFIX = "handover refused"


class NonFiniteGradient(FailedPrecondition):
    """A gradient, or its norm, is NaN or infinite: no update is made from it (clipping cannot
    make it finite, and every replica would apply the same poison). A replica refuses to APPLY
    one; the coordinator sends no APPLY for a step whose PREPARE reported one."""


class PermissionDenied(WireError):
    """The caller is known, but its credential may not do this (another submitter's job)."""


class Unauthenticated(WireError):
    """The call's credential is not one this server knows (a forged submitter token)."""


class ResourceExhausted(WireError):
    """Larger than the configured limits."""


class Busy(ResourceExhausted):
    """The replica's queue is full (push data plane): send the work to another replica; this one
    is not at fault and is not banned."""


class PeerUnavailable(SwarmError):
    """The peer did not answer: unreachable, past the call's deadline, or the call was cancelled.
    The caller may retry elsewhere; nothing says the peer refused."""


class DeadlineExceeded(PeerUnavailable):
    """A server ended a call whose caller did not send its body in time (DEADLINE_EXCEEDED):
    to that caller, as any call past its deadline, a peer that did not answer."""


class RemoteError(SwarmError):
    """The peer answered with an error that is none of the above (a bug there, an unauthenticated
    call): `code` is the gRPC status name."""

    def __init__(self, message: str, code: str = "UNKNOWN") -> None:
        super().__init__(message)
        self.code = code


class BadReply(RemoteError):
    """The peer's answer cannot be the one asked for (a tensor missing, of another shape, one
    that does not decode): the peer's fault, as an error of its own is, perhaps after it
    accumulated (`swarm.rpc.reply_checks`)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "BAD_REPLY")
