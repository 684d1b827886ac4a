"""Two users' stage servers on one card (`swarm.device.claims`), each with a umask that keeps
its files to itself (077): each must still see the other's claim. The folder's lock file and a
claim took the umask's modes, so the second user could not open the lock (its claim failed) or
read the claim (it counted the other's window as a dead one's); a review found it.

Each user is a forked child of this (root) process that drops to its own uid: an exec'd process
of another user could not reach this Python, under /root."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from swarm.device.claims import Claims

HELD = 12345


@pytest.fixture
def shared_root() -> Iterator[Path]:
    """A claims folder both users reach (a temporary one, not the host's)."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to run as two other users")
    root = Path(
        tempfile.mkdtemp(prefix="claims-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    )
    os.chmod(root, 0o1777)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _as_user(uid: int, work: Callable[[], str]) -> tuple[int, int, int]:
    """Fork a child that becomes `uid` with umask 077 and runs `work`, writing what it returns
    (or its error) to a pipe; (pid, the pipe to read, the pipe to release it by closing)."""
    said_r, said_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no return from here
        code = 0
        try:
            os.close(said_r)
            os.close(go_w)
            os.setgid(uid)
            os.setuid(uid)
            os.umask(0o077)
            try:
                text = work()
            except BaseException as e:
                text, code = f"error: {type(e).__name__}: {e}", 1
            os.write(said_w, text.encode() + b"\n")
            os.read(go_r, 1)  # holds its claim until the parent closes the pipe
        finally:
            os._exit(code)
    os.close(said_w)
    os.close(go_r)
    return pid, said_r, go_w


def _said(fd: int) -> str:
    with os.fdopen(fd) as f:
        return f.readline().strip()


def test_a_claim_of_another_user_with_umask_077_is_counted(shared_root: Path) -> None:
    claims = Claims(shared_root)

    def first() -> str:
        claim = claims.claim("GPU-0")
        claim.publish(HELD)
        return "claimed"

    def second() -> str:
        claim = claims.claim("GPU-0")
        return ",".join(str(b) for b in claim.others())

    a, a_said, a_go = _as_user(65534, first)
    try:
        assert _said(a_said) == "claimed"
        b, b_said, b_go = _as_user(65533, second)
        os.close(b_go)
        assert _said(b_said) == str(HELD)  # the first user's window, counted
        assert os.waitpid(b, 0)[1] == 0
    finally:
        os.close(a_go)
        os.waitpid(a, 0)


def test_a_claim_that_cannot_be_read_is_said_once_not_at_every_look(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Another user's claim made before claims were opened to all cannot be opened: it was said
    at WARNING at every look, and a window looks at each activation it keeps (a review found
    it). The open is refused here as the kernel refuses it there."""
    claims = Claims(tmp_path)
    mine, theirs = claims.claim("GPU-0"), claims.claim("GPU-0")
    real_open = os.open

    def refusing(path: object, *args: object, **kwargs: object) -> int:
        if Path(str(path)) == theirs.path:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", refusing)
    try:
        with caplog.at_level(logging.WARNING, logger="swarm.device.claims"):
            looks = [mine.others() for _ in range(100)]
    finally:
        monkeypatch.undo()
        mine.close()
        theirs.close()
    assert looks == [[0]] * 100  # alive, as holding nothing, at every look
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "unreadable" in said[0] and theirs.path.name in said[0], said
