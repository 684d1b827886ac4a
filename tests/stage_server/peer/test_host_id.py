"""The host id a stage server announces (its failure domain, a machine): the same for every
server on one machine, told apart across machines of one name, and replaced by SWARM_HOST_ID."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from stage_server.peer.host_id import host_id


def test_one_machine_one_id_and_another_machine_id_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SWARM_HOST_ID", raising=False)
    one, two = tmp_path / "one", tmp_path / "two"
    one.write_text("0123456789abcdef0123456789abcdef\n")
    two.write_text("fedcba9876543210fedcba9876543210\n")
    name = socket.gethostname()
    assert host_id((one,)) == host_id((one,))  # every stage server on the machine agrees
    assert host_id((one,)).startswith(f"{name}-") and len(host_id((one,))) == len(name) + 9
    assert host_id((one,)) != host_id((two,))  # another machine of the same name
    assert host_id((tmp_path / "absent", two)) == host_id((two,))  # the next file is read
    assert host_id((tmp_path / "absent",)) == name  # no machine id: the hostname alone
    monkeypatch.setenv("SWARM_HOST_ID", "rack-7")
    assert host_id((one,)) == "rack-7"
