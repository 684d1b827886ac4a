"""The wait for another process's fetch of the same item (`swarm.rpc.fetch_file.cache_lock`):
it blocked a worker thread in `flock` with no bound and said nothing, so a second stage server
of a machine waited silently for as long as the first fetched (hours on a home link), forever
if the first was stuck (SIGSTOP, a hung disk), and a cancel left the thread blocked. Now it
polls (a cancel ends it), says once what it waits for, and gives up, naming the lock, once the
other's fetch has written nothing for its stall bound."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from swarm.errors import ConfigError
from swarm.rpc.fetch_file import cache_lock


@contextmanager
def _other_fetch(lock: Path) -> Iterator[int]:
    """Another process of the machine holding `lock` (its fetch under way)."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield fd
    finally:
        os.close(fd)


async def test_a_stuck_fetch_is_waited_for_only_its_stall_bound_and_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    lock, kept = tmp_path / "locks" / "data-x", tmp_path / "data" / "x"
    kept.parent.mkdir()
    (tmp_path / "data" / "x.partial").write_bytes(b"half")  # and no more
    with _other_fetch(lock), caplog.at_level(logging.INFO):
        async with asyncio.timeout(10):  # the old wait: for ever
            with pytest.raises(ConfigError, match="has written nothing for 0 s") as e:
                async with cache_lock(lock, kept, stall_s=0.3):
                    pass
    assert str(lock) in str(e.value)
    waits = [r for r in caplog.records if "another process of this machine" in r.getMessage()]
    assert len(waits) == 1 and waits[0].levelno == logging.WARNING


async def test_a_fetch_that_goes_on_is_waited_for_and_the_lock_then_taken(tmp_path: Path) -> None:
    lock, kept = tmp_path / "locks" / "init-p", tmp_path / "init" / "p"
    partial = tmp_path / "init" / "p.partial" / "model.safetensors"
    partial.parent.mkdir(parents=True)
    got = asyncio.Event()

    async def second() -> None:
        async with cache_lock(lock, kept, stall_s=0.5):
            got.set()

    with _other_fetch(lock):
        waiting = asyncio.create_task(second())
        for i in range(8):  # 1.6 s of a fetch writing, past three stall bounds
            partial.write_bytes(b"x" * (i + 1))
            await asyncio.sleep(0.2)
        assert not got.is_set() and not waiting.done()
    await asyncio.wait_for(waiting, 5)
    assert got.is_set()


async def test_a_cancelled_wait_leaves_nothing_behind(tmp_path: Path) -> None:
    lock, kept = tmp_path / "locks" / "data-x", tmp_path / "data" / "x"
    with _other_fetch(lock):
        waiting = asyncio.create_task(_enter(lock, kept))
        await asyncio.sleep(0.2)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        before = len(os.listdir("/proc/self/fd"))
    # no thread left blocked on the lock to take it once it is free, and no descriptor open
    await asyncio.sleep(0.2)
    with _other_fetch(lock):
        pass
    assert len(os.listdir("/proc/self/fd")) == before - 1  # the test's own holder closed


async def _enter(lock: Path, kept: Path) -> None:
    async with cache_lock(lock, kept):
        raise AssertionError("taken while another held it")
