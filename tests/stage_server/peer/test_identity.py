"""A stage server's persisted peer id (`stage_server.peer.identity`): a full disk at its first
start is a one-line error naming the directory, not a traceback (a review found it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stage_server.peer.identity import PEER_ID_FILE, persistent_peer_id
from swarm.errors import ConfigError
from tests.support.disks import fill, tiny_disk


def test_a_cache_directory_with_no_room_for_the_id_is_said_in_a_line(tmp_path: Path) -> None:
    with tiny_disk(tmp_path / "cache") as cache:
        filler = fill(cache)
        with pytest.raises(ConfigError) as refused:
            persistent_peer_id(cache)
        said = str(refused.value)
        assert said.startswith(f"SWARM_CACHE_DIR {str(cache)!r}: cannot keep this peer's id")
        assert "No space left on device" in said and "--peer" in said
        filler.unlink()  # room again: the next start keeps an id, and the one after reads it
        first = persistent_peer_id(cache)
        first.release()
        again = persistent_peer_id(cache)
        again.release()
        assert first.id == again.id == (cache / PEER_ID_FILE).read_text().strip()
