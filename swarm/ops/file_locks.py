"""A file lock taken without waiting (`flock` with LOCK_NB), for the machine-wide locks whose
waits poll instead of blocking a thread: a poll can be cancelled, bounded and said, where a
thread blocked in `flock` stays blocked after its caller gave up (`swarm.rpc.fetch_file`'s
fetch lock, `swarm.rpc.cache_room`'s holds, the measuring lock)."""

from __future__ import annotations

import fcntl

__all__ = ["taken_now"]


def taken_now(fd: int, shared: bool = False) -> bool:
    """Whether the lock on `fd` (exclusive, or `shared`) was taken at once; never waits."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True
