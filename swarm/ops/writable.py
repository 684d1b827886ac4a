"""A directory a process keeps its state in, checked at start: the scheduler's checkpoints, a
stage server's cache (its peer id, its measured throughput). In a container these are volumes,
and a volume the image's user does not own is the usual mistake (`docker run -v
/srv/ckpt:/checkpoints` of a root-owned directory): said in one line at start, naming the flag
and the fix, rather than a traceback at start or, worse, a checkpoint that fails hours later."""

from __future__ import annotations

import os
from pathlib import Path

from swarm.errors import ConfigError

__all__ = ["writable_dir"]


def writable_dir(path: Path, what: str) -> Path:
    """`path`, created if missing (with its parents), once this process may create files in it;
    else a ConfigError naming `what` (the flag or variable that chose it)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        reason = "" if os.access(path, os.W_OK | os.X_OK) else "Permission denied"
    except OSError as e:
        reason = e.strerror or type(e).__name__
    if reason:
        raise ConfigError(
            f"{what} {str(path)!r}: cannot write there ({reason}); give a directory this user "
            f"(uid {os.getuid()}) can write (in a container, a volume the image's user owns: "
            "chown 10001 on the host)"
        )
    return path
