"""One file fetched from the scheduler (`swarm.rpc.fetch_file`, shared by the data file and the
starting checkpoint's files): a broken stream goes on from the partial file's size, a bounded
number of times, each failure logged with its cause; a partial left by an earlier process is
continued; bytes that do not match the pin are refused and their partial removed."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from swarm.errors import ConfigError, NotFound, PeerUnavailable
from swarm.policy.backoff import Backoff
from swarm.rpc.fetch_file import fetch_file

BYTES = bytes(range(256)) * 40  # 10240 bytes
PIN = hashlib.sha256(BYTES).hexdigest()


class _Scheduler:
    """A file served in 1000-byte chunks: each stream asked for (its offset) is kept, and the
    first `breaks` streams break after `after` bytes (a dropped link), end there (`short`), or
    send nothing more from there on (`stall`: a link gone silent, no reset ever coming)."""

    def __init__(
        self,
        served: bytes = BYTES,
        *,
        breaks: int = 0,
        after: int = 0,
        short: bool = False,
        stall: bool = False,
    ) -> None:
        self.served, self.breaks, self.after, self.short = served, breaks, after, short
        self.stall = stall
        self.asked: list[int] = []

    async def source(self, offset: int) -> AsyncIterator[bytes]:
        self.asked.append(offset)
        broken = len(self.asked) <= self.breaks
        for at in range(offset, len(self.served), 1000):
            if broken and at >= offset + self.after:
                if self.short:
                    return
                if self.stall:
                    await asyncio.Event().wait()
                raise PeerUnavailable("UNAVAILABLE: Connection reset by peer")
            yield self.served[at : at + 1000]


def _quick() -> Backoff:
    return Backoff(first_s=0.001, cap_s=0.001)


async def test_a_broken_stream_goes_on_from_the_partial_files_size(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kept, scheduler = tmp_path / "kept", _Scheduler(breaks=2, after=3000)
    with caplog.at_level(logging.WARNING, "swarm.rpc.fetch_file"):
        await fetch_file(
            scheduler.source, kept, sha256=PIN, size=len(BYTES), what="f", backoff=_quick()
        )
    assert kept.read_bytes() == BYTES and not (tmp_path / "kept.partial").exists()
    assert scheduler.asked == [0, 3000, 6000]  # each from what the partial file held
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and all("Connection reset by peer" in s for s in said), said


async def test_a_stream_that_ends_short_is_asked_again(tmp_path: Path) -> None:
    kept, scheduler = tmp_path / "kept", _Scheduler(breaks=1, after=5000, short=True)
    await fetch_file(
        scheduler.source, kept, sha256=PIN, size=len(BYTES), what="f", backoff=_quick()
    )
    assert kept.read_bytes() == BYTES and scheduler.asked == [0, 5000]


async def test_a_partial_left_by_an_earlier_process_is_continued(tmp_path: Path) -> None:
    kept, scheduler = tmp_path / "kept", _Scheduler()
    (tmp_path / "kept.partial").write_bytes(BYTES[:4321])
    await fetch_file(scheduler.source, kept, sha256=PIN, size=len(BYTES), what="f")
    assert kept.read_bytes() == BYTES and scheduler.asked == [4321]


async def test_retries_are_bounded_and_the_last_cause_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kept, scheduler = tmp_path / "kept", _Scheduler(breaks=100, after=1000)
    refused = pytest.raises(PeerUnavailable, match="Connection reset")
    with caplog.at_level(logging.WARNING, "swarm.rpc.fetch_file"), refused:
        await fetch_file(scheduler.source, kept, sha256=PIN, attempts=4, what="f", backoff=_quick())
    assert scheduler.asked == [0, 1000, 2000, 3000] and not kept.exists()
    assert [r.levelname for r in caplog.records] == ["WARNING"] * 3 + ["ERROR"]


async def test_a_final_error_is_not_asked_again(tmp_path: Path) -> None:
    asked = []

    async def refusing(offset: int) -> AsyncIterator[bytes]:
        asked.append(offset)
        raise NotFound("unknown job")
        yield b""

    with pytest.raises(NotFound):
        await fetch_file(refusing, tmp_path / "kept", sha256=PIN, what="f")
    assert asked == [0]


async def test_bytes_that_do_not_match_the_pin_are_refused_and_the_partial_removed(
    tmp_path: Path,
) -> None:
    changed = BYTES[:-1] + b"!"
    kept, scheduler = tmp_path / "kept", _Scheduler(changed)
    with pytest.raises(ConfigError, match="refused and removed") as info:
        await fetch_file(scheduler.source, kept, sha256=PIN, size=len(BYTES), what="f")
    assert PIN in str(info.value) and hashlib.sha256(changed).hexdigest() in str(info.value)
    assert list(tmp_path.iterdir()) == []  # neither the file nor its partial


async def test_a_file_longer_than_it_may_be_is_refused_as_it_comes(tmp_path: Path) -> None:
    scheduler = _Scheduler(BYTES + BYTES)
    with pytest.raises(ConfigError, match="longer than the 10240 bytes"):
        await fetch_file(scheduler.source, tmp_path / "kept", sha256=PIN, size=len(BYTES), what="f")
    assert list(tmp_path.iterdir()) == []


async def test_a_stream_gone_silent_is_asked_again_after_its_stall_bound(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A link that goes silent with no reset (a home router's NAT entry dropped, say): each
    stream had one deadline for its whole length (an hour), so a fetch sat that long on a
    stream sending nothing. Now a stream that sends nothing for `stall_s` is given up and asked
    again from the partial file's size."""
    kept, scheduler = tmp_path / "kept", _Scheduler(breaks=1, after=4000, stall=True)
    with caplog.at_level(logging.WARNING, "swarm.rpc.fetch_file"):
        fetching = fetch_file(
            scheduler.source,
            kept,
            sha256=PIN,
            size=len(BYTES),
            what="f",
            backoff=_quick(),
            stall_s=0.2,
        )
        await asyncio.wait_for(fetching, 10)
    assert kept.read_bytes() == BYTES and scheduler.asked == [0, 4000]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "nothing came for 0.2 s" in said[0], said


async def test_a_stream_slow_to_begin_is_not_given_up_by_the_stall_bound(tmp_path: Path) -> None:
    """The scheduler hashes a whole checkpoint before a file's first byte (a restarted one has
    no cache of it): 100 GB take longer than the stall bound. That wait is the stream's own
    deadline's; the stall bound is between bytes, once they come."""
    kept, asked = tmp_path / "kept", []

    async def slow_to_begin(offset: int) -> AsyncIterator[bytes]:
        asked.append(offset)
        await asyncio.sleep(0.5)  # hashing, past the stall bound
        for at in range(offset, len(BYTES), 1000):
            yield BYTES[at : at + 1000]

    fetching = fetch_file(
        slow_to_begin, kept, sha256=PIN, size=len(BYTES), what="f", backoff=_quick(), stall_s=0.2
    )
    await asyncio.wait_for(fetching, 10)
    assert kept.read_bytes() == BYTES and asked == [0]


async def test_a_fetched_file_is_on_disk_before_it_takes_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A file under its final name is taken as whole by size alone at a later start (a
    # checkpoint's files resumed after a restart: `swarm.rpc.init_fetch`). Renamed before its
    # bytes were on disk, a power cut could leave it its size and no bytes; so its bytes are
    # synced, then it is renamed, then its directory is synced (before: no sync at all).
    import os

    done: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        done.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: object, dst: object) -> None:
        done.append(("replace", str(dst)))
        real_replace(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    kept = tmp_path / "data.bin"
    await fetch_file(_Scheduler().source, kept, sha256=PIN, size=len(BYTES), what="the data")
    assert kept.read_bytes() == BYTES
    assert done == [
        ("fsync", str(tmp_path / "data.bin.partial")),
        ("replace", str(kept)),
        ("fsync", str(tmp_path)),
    ], done
