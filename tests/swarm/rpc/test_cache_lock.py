"""The wait for another process's fetch of the same item (`swarm.rpc.fetch_file.cache_lock`):
it blocked a worker thread in `flock` with no bound and said nothing, so a second stage server
of a machine waited silently for as long as the first fetched (hours on a home link), for ever
if the first was stopped or hung, and a cancel left the thread blocked. Now it polls (a cancel
ends it), says once what it waits for, and gives up, naming the lock, once the holder's
heartbeat (the lock file stamped every `LOCK_BEAT_S` while held) is `stall_s` old; a live holder,
however slow its fetch (a scheduler hashing a checkpoint for an hour before the first byte),
keeps it waiting."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from swarm.errors import ConfigError
from swarm.ops.file_locks import taken_now
from swarm.rpc import fetch_file
from swarm.rpc.fetch_file import cache_lock


@contextmanager
def _other_fetch(lock: Path, age_s: float = 0.0) -> Iterator[int]:
    """Another process of the machine holding `lock` (its fetch under way), its last heartbeat
    `age_s` ago."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    then = time.time() - age_s
    os.utime(fd, (then, then))
    try:
        yield fd
    finally:
        os.close(fd)


async def test_a_holder_whose_heartbeat_stopped_is_given_up_on_and_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    lock, kept = tmp_path / "locks" / "data-x", tmp_path / "data" / "x"
    with _other_fetch(lock, age_s=600.0), caplog.at_level(logging.INFO):  # stopped 10 min ago
        async with asyncio.timeout(10):  # the old wait: for ever
            with pytest.raises(ConfigError, match="heartbeat has not come for 1 s") as e:
                async with cache_lock(lock, kept, stall_s=1.0):
                    pass
    assert str(lock) in str(e.value)
    waits = [r for r in caplog.records if "another process of this machine" in r.getMessage()]
    assert len(waits) == 1 and waits[0].levelno == logging.WARNING


async def test_a_lock_file_with_an_old_time_is_waited_for_its_bound_from_the_waiters_arrival(
    tmp_path: Path,
) -> None:
    """A removal of a stale partial holds the fetch lock without a heartbeat, its file a day
    old (and a new holder's first stamp comes just after its lock): read against the wall
    clock, the waiter gave up at its first look and refused the job."""
    lock, kept = tmp_path / "locks" / "data-x", tmp_path / "data" / "x"
    with _other_fetch(lock, age_s=86400.0):
        waiting = asyncio.create_task(_take(lock, kept, stall_s=5.0))
        await asyncio.sleep(1.0)  # the removal's rmtree
        assert not waiting.done()
    assert await asyncio.wait_for(waiting, 5)


async def _take(lock: Path, kept: Path, stall_s: float) -> bool:
    async with cache_lock(lock, kept, stall_s=stall_s):
        return True


async def test_a_live_holder_however_slow_is_waited_for_and_the_lock_then_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The holder writes nothing (its stream waits for a first byte) but beats: waited for past
    several stall bounds, and the lock taken once it lets go; then this one beats."""
    monkeypatch.setattr(fetch_file, "LOCK_BEAT_S", 0.1)
    lock, kept = tmp_path / "locks" / "init-p", tmp_path / "init" / "p"
    got = asyncio.Event()
    release = asyncio.Event()

    async def second() -> None:
        async with cache_lock(lock, kept, stall_s=0.5):
            got.set()
            stamped = os.stat(lock).st_mtime
            await asyncio.sleep(0.5)
            assert os.stat(lock).st_mtime > stamped, "a holder's heartbeat"
            await release.wait()

    with _other_fetch(lock) as fd:
        waiting = asyncio.create_task(second())
        for _ in range(8):  # 1.6 s: past three stall bounds, beating
            os.utime(fd)
            await asyncio.sleep(0.2)
        assert not got.is_set() and not waiting.done()
    await asyncio.wait_for(got.wait(), 5)
    release.set()
    await asyncio.wait_for(waiting, 5)


async def test_a_cancelled_wait_leaves_nothing_held_or_blocked(tmp_path: Path) -> None:
    lock, kept = tmp_path / "locks" / "data-x", tmp_path / "data" / "x"
    with _other_fetch(lock):
        before = len(os.listdir("/proc/self/fd"))
        waiting = asyncio.create_task(_enter(lock, kept))
        await asyncio.sleep(0.2)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert len(os.listdir("/proc/self/fd")) == before  # its descriptor closed
    # free at once: no thread left blocked in flock to take it behind the test's back
    fd = os.open(lock, os.O_RDWR)
    try:
        assert taken_now(fd)
    finally:
        os.close(fd)


async def _enter(lock: Path, kept: Path) -> None:
    async with cache_lock(lock, kept):
        raise AssertionError("taken while another held it")
