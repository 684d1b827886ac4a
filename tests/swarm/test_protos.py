"""The committed generated code is exactly what `make protos` produces from protos/."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from swarm.protogen import ROOT, generate


def test_generated_code_matches_protos(tmp_path: Path) -> None:
    fresh = {p.name: p.read_text() for p in generate(tmp_path)}
    committed = {p.name: p.read_text() for p in (ROOT / "swarm" / "proto").glob("*_pb2*.py*")}
    assert fresh, "protoc produced nothing"
    assert sorted(fresh) == sorted(committed), "run `make protos` and commit the result"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"out of date: {stale}; run `make protos` and commit the result"


def _lowest(requirement: str) -> tuple[int, ...]:
    found = re.search(r">=\s*([0-9.]+)", requirement)
    assert found, f"{requirement}: no lower bound"
    return tuple(int(x) for x in found.group(1).split("."))


def test_the_declared_ranges_admit_no_version_the_generated_code_refuses() -> None:
    """An install within pyproject's ranges imports swarm.proto: the generated code's own checks
    (protobuf's runtime version, the gRPC stubs' generated version) ask no newer versions."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    declared = {re.split(r"[<>=!~ ]", d, maxsplit=1)[0]: d for d in deps}
    proto = ROOT / "swarm" / "proto"
    for path in proto.glob("*_pb2.py"):
        demanded = re.search(
            r"ValidateProtobufRuntimeVersion\(\s*\S+,\s*(\d+),\s*(\d+),\s*(\d+),", path.read_text()
        )
        assert demanded, path.name
        need = tuple(int(x) for x in demanded.groups())
        assert _lowest(declared["protobuf"]) >= need, f"{path.name} demands protobuf {need}"
        assert f"<{need[0] + 1}" in declared["protobuf"], "protobuf's gencode checks the major too"
    for path in proto.glob("*_pb2_grpc.py"):
        demanded = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", path.read_text())
        assert demanded, path.name
        need = tuple(int(x) for x in demanded.group(1).split("."))
        for name in ("grpcio", "grpcio-health-checking"):
            assert _lowest(declared[name]) >= need, f"{path.name} demands {name} {need}"
