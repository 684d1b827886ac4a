"""The committed generated code is exactly what `make protos` produces from protos/."""

from __future__ import annotations

from pathlib import Path

from swarm.protogen import ROOT, generate


def test_generated_code_matches_protos(tmp_path: Path) -> None:
    fresh = {p.name: p.read_text() for p in generate(tmp_path)}
    committed = {p.name: p.read_text() for p in (ROOT / "swarm" / "proto").glob("*_pb2*.py*")}
    assert fresh, "protoc produced nothing"
    assert sorted(fresh) == sorted(committed), "run `make protos` and commit the result"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"out of date: {stale}; run `make protos` and commit the result"
