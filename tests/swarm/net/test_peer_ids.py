"""One rule for a peer id (`swarm.net.peer_ids`), checked where `--peer` is read: an id a round
ticket could not carry (over 128 characters, or a character outside `[A-Za-z0-9._-]`) was taken,
and the peer then failed every round of its stage ("a malformed round ticket")."""

from __future__ import annotations

import pytest

from swarm.cli import parse
from swarm.net.peer_ids import MAX_PEER_ID_CHARS, is_peer_id


def test_the_rule() -> None:
    assert is_peer_id("gpu1.alice") and is_peer_id("home-gpu-1") and is_peer_id("a_b")
    assert is_peer_id("x" * MAX_PEER_ID_CHARS)
    assert not is_peer_id("x" * (MAX_PEER_ID_CHARS + 1))
    for bad in ("", "a b", "a/b", "peer\0", "é"):
        assert not is_peer_id(bad), bad


@pytest.mark.parametrize("command", ["stage-server", "aggregator"])
def test_peer_flag_takes_a_peer_id_only(
    command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SWARM_PEER", raising=False)
    assert parse([command, "--peer", "gpu1.alice"]).peer == "gpu1.alice"
    assert parse([command]).peer == ""  # the id persisted in the cache directory
    for bad in ("x" * (MAX_PEER_ID_CHARS + 1), "my gpu"):
        with pytest.raises(SystemExit) as exited:
            parse([command, "--peer", bad])
        assert exited.value.code == 2
        assert "is not a peer id: 1 to 128 letters, digits" in capsys.readouterr().err
