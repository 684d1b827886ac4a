"""A refusal told ahead (`swarm.net.told_ahead`) is what a client whose write raced the call's
end reads, in place of grpc-aio's INTERNAL; nothing else is read as one."""

from __future__ import annotations

import grpc

from swarm.errors import Aborted, Busy, RemoteError
from swarm.net.told_ahead import (
    RACE_DETAILS,
    TOLD_CODE_KEY,
    TOLD_DETAILS_BYTES,
    TOLD_DETAILS_KEY,
    cut_details,
)
from swarm.rpc.status import ERROR_KEY, MISSING_KEY, from_rpc_error

Metadata = tuple[tuple[str, str | bytes], ...]
BUSY: Metadata = (
    (TOLD_CODE_KEY, "RESOURCE_EXHAUSTED"),
    (TOLD_DETAILS_KEY, b"the budget is in use: 8 KiB free"),
    (ERROR_KEY, "Busy"),
)


def _raced(initial: Metadata, details: str = RACE_DETAILS) -> grpc.aio.AioRpcError:
    """What grpc-aio raises from a write that lost the race with the call's end."""
    return grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, initial, (), details)


def test_a_raced_write_is_told_the_refusal_that_came_ahead() -> None:
    error = from_rpc_error(_raced(BUSY))
    assert type(error) is Busy
    assert str(error) == "the budget is in use: 8 KiB free"


def test_an_aborted_round_keeps_its_missing_members() -> None:
    ahead: Metadata = (
        (TOLD_CODE_KEY, "ABORTED"),
        (TOLD_DETAILS_KEY, b"a part never came"),
        (MISSING_KEY, "1,3"),
    )
    error = from_rpc_error(_raced(ahead))
    assert type(error) is Aborted and error.missing == (1, 3)


def test_only_the_race_is_read_from_what_came_ahead() -> None:
    # A server's own INTERNAL (a bug there) is what it said, whatever came ahead.
    bug = from_rpc_error(_raced(BUSY, "RuntimeError: boom"))
    assert isinstance(bug, RemoteError) and bug.code == "INTERNAL"
    # The race with nothing told ahead (an older server), or an OK or unknown code told.
    for ahead in [(), ((TOLD_CODE_KEY, "OK"),), ((TOLD_CODE_KEY, "NO_SUCH_CODE"),)]:
        error = from_rpc_error(_raced(ahead))
        assert isinstance(error, RemoteError) and RACE_DETAILS in str(error)


def test_a_long_refusal_is_told_ahead_cut_at_a_character() -> None:
    told = cut_details("é" * TOLD_DETAILS_BYTES)
    assert len(told) <= TOLD_DETAILS_BYTES and told.endswith(b"...")
    assert told.decode()  # whole characters only
