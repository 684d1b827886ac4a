"""Generate `swarm/proto/*_pb2*.py` from `protos/`; `make protos` runs this, and a test checks that
regenerating leaves the committed files unchanged."""

from __future__ import annotations

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
    return sorted((out_dir / "swarm" / "proto").glob("*_pb2*.py*"))


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT):
        print(path)
