"""A refusal whose status a write lost, with nothing told ahead of it: asked again, once, by a
unary probe of the same server.

grpc-aio ends a stream call whose write failed with a status of its own, INTERNAL "Internal error
from Core" (grpc/grpc#36066), and takes the call's initial metadata for empty where it had not
read it yet: the server's status and what it told ahead (`swarm.net.told_ahead`) are both lost.
Told ahead, a refusal is read back from the initial metadata; where the write's failure came
first (about 1 call in 100 of 30 refused at once on a loaded machine: 3 of 300 in a suite run),
nothing is. The caller then knows only that the server ended the call while it wrote.

A unary call does not race so (its message, half-close and status are one batch), and a refusal
of the caller (the token, the rate of refusals) is the server's answer to a probe as much as to
the stream: `StageService.Info`, which a stage server and an aggregator both answer, asked over
the same channel with the same credentials, costs one small call per lost status and is bounded
by `PROBE_S`. Its refusal becomes the call's error (by its code), said to be a probe's; an answer,
or a probe that learnt nothing (no answer in time, no Info served), leaves the INTERNAL, saying
so."""

from __future__ import annotations

import asyncio

import grpc

from swarm.net.told_ahead import RACE_DETAILS, told
from swarm.proto import stage_pb2 as pb
from swarm.proto import stage_pb2_grpc

__all__ = ["PROBE_S", "asked_again", "lost"]

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


async def asked_again(
    error: grpc.RpcError, channel: grpc.aio.Channel, timeout: float = PROBE_S
) -> grpc.RpcError:
    """`error`, or, where its status was `lost`, what one probe of the server over `channel`
    tells: the refusal it meets, as this call's error; else the INTERNAL, saying what the probe
    found."""
    if not lost(error):
        return error
    initial = error.initial_metadata() or ()  # type: ignore[attr-defined]
    try:
        await stage_pb2_grpc.StageServiceStub(channel).Info(pb.StageInfoRequest(), timeout=timeout)
        found = "a probe of the same server was answered"
    except grpc.RpcError as refusal:
        code: grpc.StatusCode = refusal.code()  # type: ignore[attr-defined]
        details = refusal.details() or code.name  # type: ignore[attr-defined]
        if code in _TOLD:  # its code alone: no error class the probe's trailers might name
            return grpc.aio.AioRpcError(code, initial, (), f"{details} ({_PROBED})")
        found = f"a probe of the same server learnt nothing ({code.name}: {details})"
    except grpc.aio.UsageError:  # the client closed its channel meanwhile
        found = "its channel was closed before a probe"
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # the caller's own cancellation
        found = "its channel was closed during a probe"  # as `StageClient`'s boundary reads it
    details = f"{RACE_DETAILS}: the server ended the call as it was written; {found}"
    trailing = error.trailing_metadata() or ()  # type: ignore[attr-defined]
    return grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, initial, trailing, details)
