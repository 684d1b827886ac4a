"""A refusal told twice: in the call's initial metadata, then as its status, so that a client
whose write raced the refusal still reads why.

grpc-aio clients (grpcio 1.85; grpc/grpc#36066) report a write that loses the race with the
server's early end as INTERNAL ("Internal error from Core"): the failed write overwrites the
status the server sent, its trailing metadata with it. The initial metadata the client received
before that status is kept. So a server that refuses a call names the refusal there first
(`refuse`: its code, its text, and the class and members `swarm.rpc.status` names), and a client
that meets that INTERNAL reads the refusal back from it (`told`, which `from_rpc_error` asks).

Nothing is read or held for it, however many calls are refused at once: where the server's
reading of a refused stream (`swarm.net.refused_streams`, which avoids the race for the first
few) is past its bound, the refusal still reaches its client. A refusal after the call's initial
metadata went (a stream answered part-way) is told as its status alone, as before: its client
has written all it will by then."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, NoReturn

import grpc

__all__ = [
    "RACE_DETAILS",
    "TOLD_CODE_KEY",
    "TOLD_DETAILS_BYTES",
    "TOLD_DETAILS_KEY",
    "cut_details",
    "refuse",
    "told",
]

RACE_DETAILS = "Internal error from Core"
"""The details grpc-aio gives a write that lost the race with the call's end (in place of the
status the server sent)."""
TOLD_CODE_KEY = "swarm-refused"
"""Initial-metadata key of a refusal's status code, by name ("NOT_FOUND")."""
TOLD_DETAILS_KEY = "swarm-refused-details-bin"
"""Initial-metadata key of a refusal's text, as UTF-8 (binary: any text crosses as it is)."""
TOLD_DETAILS_BYTES = 2048
"""The most of a refusal's text told ahead: initial metadata has a size limit (8 KiB by
default) that a longer text, base64-encoded, could pass; the status keeps the whole text."""

Metadata = Sequence[tuple[str, str | bytes]]


async def refuse(
    context: grpc.aio.ServicerContext,
    code: grpc.StatusCode,
    details: str,
    trailing: Metadata = (),
) -> NoReturn:
    """End the call with `code`, `details` and `trailing` metadata, told in its initial metadata
    first where none was sent yet."""
    ahead = [(TOLD_CODE_KEY, code.name), (TOLD_DETAILS_KEY, cut_details(details))]
    # Sent already (a stream answered part-way): told by the status alone. Or the call is gone
    # (its batch failed): the abort ends it as it would have.
    with contextlib.suppress(grpc.aio.UsageError, grpc.aio.InternalError):
        await context.send_initial_metadata((*ahead, *trailing))
    await context.abort(code, details, trailing_metadata=tuple(trailing))
    raise AssertionError("context.abort returned")  # it raises; this satisfies NoReturn


def told(error: grpc.RpcError) -> grpc.RpcError:
    """`error`, or, where it is the race's INTERNAL and its call's initial metadata names a
    refusal (`refuse`), that refusal as the error its status would have been: its code, its
    text, and the rest of what came ahead as its trailing metadata."""
    code: Any = error.code()  # type: ignore[attr-defined]
    if code != grpc.StatusCode.INTERNAL or error.details() != RACE_DETAILS:  # type: ignore[attr-defined]
        return error
    initial: Metadata = error.initial_metadata() or ()  # type: ignore[attr-defined]
    name = next((v for k, v in initial if k == TOLD_CODE_KEY), None)
    told_code = next((c for c in grpc.StatusCode if c.name == name), None)
    if told_code is None or told_code == grpc.StatusCode.OK:  # nothing told, or not a refusal
        return error
    text = next((v for k, v in initial if k == TOLD_DETAILS_KEY), b"")
    details = text.decode(errors="replace") if isinstance(text, bytes) else text
    rest = tuple((k, v) for k, v in initial if k not in (TOLD_CODE_KEY, TOLD_DETAILS_KEY))
    return grpc.aio.AioRpcError(told_code, tuple(initial), rest, details)


def cut_details(details: str) -> bytes:
    """`details` as UTF-8, at most `TOLD_DETAILS_BYTES` (cut at a character's start)."""
    data = details.encode()
    if len(data) <= TOLD_DETAILS_BYTES:
        return data
    return data[: TOLD_DETAILS_BYTES - 3].decode(errors="ignore").encode() + b"..."
