"""A stage server's peer id, kept in a file under its cache directory and locked while it runs.

Why a file: the id names the peer's retained topics and is its MQTT username (the broker's ACL
lets it publish only its own topics), so a restarted server must come back as the same peer.
Why a lock: two stage servers sharing one cache directory (one per device, say) must never share
an id, so each holds an exclusive `flock` on the file it read for as long as it runs, and a second
server takes the next free file (`peer-id`, `peer-id.1`, ...). The lock lives with the open file:
releasing the identity (or the process dying) frees the id for the next server.

The id outlives the process; its incarnation (`new_incarnation`) does not: announced with every
announcement of one process, its last-will included, it tells the scheduler a peer that
reconnected (the same process) from one restarted under the same id.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import secrets
import socket
from pathlib import Path
from typing import IO

from swarm.errors import ConfigError
from swarm.ops.writable import writable_dir

__all__ = ["PEER_ID_FILE", "PeerIdentity", "cache_dir", "new_incarnation", "persistent_peer_id"]

log = logging.getLogger(__name__)

PEER_ID_FILE = "peer-id"
_MAX_SLOTS = 64  # stage servers sharing one cache directory (one per device, say)
_ID_CHARS = re.compile(r"[^A-Za-z0-9._-]")


def cache_dir() -> Path:
    """The directory a peer keeps its files in (its id, the machine's measured figures):
    `SWARM_CACHE_DIR`, else `~/.cache/swarm`. Every stage server of a machine shares it."""
    root = os.environ.get("SWARM_CACHE_DIR") or Path.home() / ".cache" / "swarm"
    return Path(root)


class PeerIdentity:
    """A peer id, and the lock on the file it was read from while this process runs (a second
    stage server sharing the cache directory takes the next file, so it gets an id of its own)."""

    def __init__(self, peer: str, held: IO[str] | None = None) -> None:
        self.id, self._held = peer, held

    def release(self) -> None:
        if self._held is not None:
            self._held.close()  # closing the file drops its lock
            self._held = None


def persistent_peer_id(cache_dir: Path, given: str = "") -> PeerIdentity:
    """This stage server's id: `given` (`--peer`) if set, else the one persisted under
    `cache_dir` (`peer-id`, created once as `<hostname>-<random>`), the same after every restart.
    Stage servers running at once from one cache directory lock a file each (`peer-id`,
    `peer-id.1`, ...), so each has its own id, and each keeps it across restarts. The id is also
    the peer's MQTT username (the broker's ACL lets it publish only its own topics)."""
    if given:
        return PeerIdentity(given)
    writable_dir(cache_dir, "SWARM_CACHE_DIR")  # its id lives there: said at start, in a line
    for slot in range(_MAX_SLOTS):
        path = cache_dir / (PEER_ID_FILE if slot == 0 else f"{PEER_ID_FILE}.{slot}")
        f = open(path, "a+", encoding="utf-8")  # noqa: SIM115 (held open: the lock lives with it)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()  # another stage server runs with this one
            continue
        f.seek(0)
        peer = f.read().strip()
        if not peer or _ID_CHARS.search(peer):
            host = _ID_CHARS.sub("-", socket.gethostname()) or "peer"
            peer = f"{host}-{secrets.token_hex(4)}"
            try:
                f.seek(0)
                f.truncate()
                f.write(peer + "\n")
                f.flush()
                os.fsync(f.fileno())
            except OSError as e:  # a full disk: the start fails in a line, not a traceback
                with contextlib.suppress(OSError):  # its close flushes the same write again
                    f.close()
                raise ConfigError(
                    f"SWARM_CACHE_DIR {str(cache_dir)!r}: cannot keep this peer's id in "
                    f"{path.name} ({e.strerror or e}); free room there, or give --peer"
                ) from None
            log.info("new peer id %s (kept in %s)", peer, path)
        return PeerIdentity(peer, f)
    raise ConfigError(
        f"{_MAX_SLOTS} stage servers already run from {cache_dir}; give each a --peer id"
    )


def new_incarnation() -> str:
    """A fresh start id for this process's announcements (`PeerAnnouncement.incarnation`)."""
    return secrets.token_hex(8)
