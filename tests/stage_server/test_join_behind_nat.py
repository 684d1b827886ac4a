"""A friend behind NAT joins with the invite alone (issue 51, item 6): an invite made without
`--host` says its peer is reached through a relay, and `swarm stage-server --join FILE` then
attaches to a relay at its start as `--behind-nat` does; the friend adds no flag. Before, the
invite did not say, and the stage server waited for the scheduler's dial-back to fail first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swarm import cli
from swarm.errors import ConfigError
from swarm.net import invite


def _stage_server(path: Path, *more: str) -> bool:
    """`swarm stage-server --join path ...` parsed and joined as the CLI does: --behind-nat."""
    args = cli.parse(["stage-server", "--join", str(path), "--device", "cpu", *more])
    invite.apply_join(args)
    return bool(args.behind_nat)


def _made(tmp_path: Path, hosts: list[str]) -> Path:
    path = tmp_path / f"alice-{len(hosts)}.invite.json"
    made = invite.make("alice", "mqtt://h:1883", "h:7700", ca_dir=None, hosts=hosts, token="t")
    invite.write(made, path)
    return path


def test_an_invite_without_a_host_makes_the_stage_server_behind_nat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SWARM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("SWARM_BEHIND_NAT", raising=False)
    nat = _made(tmp_path, [])
    assert json.loads(nat.read_text())["reached"] == "relay"
    assert _stage_server(nat), "no --host: behind NAT, attached to a relay from its start"
    direct = _made(tmp_path, ["203.0.113.7"])
    assert json.loads(direct.read_text())["reached"] == "direct"
    assert not _stage_server(direct), "dialled at its --host: no relay until one is needed"
    assert _stage_server(direct, "--behind-nat"), "the flag still says so itself"
    # An invite made before the field: nothing implied, as before.
    older = tmp_path / "older.invite.json"
    doc = json.loads(nat.read_text())
    del doc["reached"]
    older.write_text(json.dumps(doc))
    assert not _stage_server(older)
    doc["reached"] = "sideways"
    older.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="not relay or direct"):
        _stage_server(older)
