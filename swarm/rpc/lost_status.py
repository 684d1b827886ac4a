"""A refusal whose status a write lost, with nothing told ahead of it: asked again, once, by a
unary probe of the same server.

grpc-aio ends a stream call whose write failed with a status of its own, INTERNAL "Internal error
from Core" (grpc/grpc#36066), and takes the call's initial metadata for empty where it had not
read it yet: the server's status and what it told ahead (`swarm.net.told_ahead`) are both lost.
Told ahead, a refusal is read back from the initial metadata; where the write's failure came
first (about 1 call in 100 of 30 refused at once on a loaded machine: 3 of 300 in a suite run),
nothing is. The caller then knows only that the server ended the call while it wrote.

A unary call does not race so (its message, half-close and status are one batch), and a refusal
of the caller from its header (the token) is the server's answer to a probe as much as to the
stream: `StageService.Info`, asked with the same credentials on the client's control channel
(answers of Info's size only), costs one small call per lost status, within what is left of the
call's deadline and at most `PROBE_S`. Its refusal becomes the call's error (by its code), said
to be a probe's; a client closed meanwhile is UNAVAILABLE, as any call closed under it; an
answer, or a probe that learnt nothing (no answer in time, no Info served), leaves the INTERNAL,
saying so. A server that answers its own INTERNAL of the same text is asked too: it costs its
caller no more than the call's own deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc

from swarm.deadline import cancelled_since, cancels
from swarm.errors import PeerUnavailable
from swarm.net.told_ahead import RACE_DETAILS, told

__all__ = ["PROBE_S", "Probe", "asked_again", "lost"]

PROBE_S = 5.0
"""The most a probe of a server whose refusal was lost may take (seconds)."""

# What a probe's failure says of the server rather than of the probe: a refusal of the caller
# from its header (its credentials), or the server gone. The rest teach nothing (no Info served,
# the probe's own deadline), and a busy answer to the probe says nothing of how far the stream
# got: the push plane takes Busy for "nothing taken", so it is never adopted.
_TOLD = frozenset(
    {
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAVAILABLE,
    }
)
_PROBED = (
    "the call's own status was lost to a write that raced the server's end of it "
    "(grpc/grpc#36066); a probe of the same server was told this"
)


def lost(error: grpc.RpcError) -> bool:
    """Whether `error` is the write race's INTERNAL with nothing told ahead to read it by."""
    code = error.code()  # type: ignore[attr-defined]
    details = error.details()  # type: ignore[attr-defined]
    return code == grpc.StatusCode.INTERNAL and details == RACE_DETAILS and told(error) is error


Probe = Callable[[float], Awaitable[object]]
"""One unary call of the server (`StageService.Info`) with the given timeout (seconds); its
refusal raises `grpc.RpcError`, a client closed under it `PeerUnavailable`."""


async def asked_again(error: grpc.RpcError, probe: Probe, left_s: float) -> grpc.RpcError:
    """`error`, or, where its status was `lost`, what one `probe` of the server tells within
    `left_s` (at most `PROBE_S`; none where nothing is left): the refusal it meets, as this
    call's error; a client closed under it, UNAVAILABLE as for any call it was closed under;
    else the INTERNAL, saying what the probe found."""
    if not lost(error):
        return error
    initial = error.initial_metadata() or ()  # type: ignore[attr-defined]
    found = await _probed(probe, min(PROBE_S, left_s))
    if isinstance(found, tuple):
        code, details = found
        return grpc.aio.AioRpcError(code, initial, (), details)
    details = f"{RACE_DETAILS}: the server ended the call as it was written; {found}"
    trailing = error.trailing_metadata() or ()  # type: ignore[attr-defined]
    return grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, initial, trailing, details)


async def _probed(probe: Probe, timeout: float) -> tuple[grpc.StatusCode, str] | str:
    """The status to adopt (code, text), or what the probe found instead."""
    if timeout <= 0:
        return "no time was left of its deadline to ask the server why"
    before = cancels()
    try:
        await probe(timeout)
        return "a probe of the same server was answered"
    except grpc.RpcError as refusal:
        code: grpc.StatusCode = refusal.code()  # type: ignore[attr-defined]
        details = refusal.details() or code.name  # type: ignore[attr-defined]
        if code in _TOLD:  # its code alone: no error class the probe's trailers might name
            return code, f"{details} ({_PROBED})"
        return f"a probe of the same server learnt nothing ({code.name}: {details})"
    except (PeerUnavailable, grpc.aio.UsageError):  # the client was closed meanwhile
        return grpc.StatusCode.UNAVAILABLE, "the connection was closed before a probe of it"
    except grpc.aio.BaseError as e:  # grpc-aio's own failures of the probe's batch
        return f"a probe of the same server learnt nothing ({type(e).__name__}: {e})"
    except asyncio.CancelledError:
        if cancelled_since(before):
            raise  # the caller's own cancellation
        # as `StageClient`'s boundary reads a channel closed under a call
        return grpc.StatusCode.UNAVAILABLE, "the connection was closed during a probe of it"
