"""Generate `swarm/proto/*_pb2*.py` from `protos/`; `make protos` runs this, and a test checks that
regenerating leaves the committed files unchanged."""

from __future__ import annotations

import re
import sys
from pathlib import Path

__all__ = ["generate"]

ROOT = Path(__file__).resolve().parent.parent


def generate(out_dir: Path, proto_root: Path = ROOT / "protos") -> list[Path]:
    """Compile every proto under `proto_root` into `out_dir` (files land in out_dir/swarm/proto)."""
    import importlib.resources

    from grpc_tools import protoc  # a dev dependency: only needed to regenerate

    protos = sorted(proto_root.rglob("*.proto"))
    include = importlib.resources.files("grpc_tools") / "_proto"
    args = [
        "protoc",
        f"-I{proto_root}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {[p.name for p in protos]}")
    for stubs in (out_dir / "swarm" / "proto").glob("*_pb2_grpc.py"):
        stubs.write_text(framed(stubs.read_text()))
    return sorted((out_dir / "swarm" / "proto").glob("*_pb2*.py*"))


_SERIALIZE = re.compile(r"\b[\w.]+\.SerializeToString\b")
_PARSE = re.compile(r"\b([\w.]+)\.FromString\b")


def framed(stubs: str) -> str:
    """Generated stubs and servicers with `swarm.proto.framing`'s (de)serializers in place of
    protobuf's, so that a chunk crosses gRPC with one copy each way (protoc has no option for
    it)."""
    if "SerializeToString" not in stubs:
        return stubs
    stubs = _PARSE.sub(r"_framing.deserializer(\1)", _SERIALIZE.sub("_framing.serialize", stubs))
    uses = "import grpc\n\nfrom swarm.proto import framing as _framing\n"
    return stubs.replace("import grpc\n", uses, 1)


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT):
        print(path)
