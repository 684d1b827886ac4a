"""Run `swarm ...` as its own process, as a user would; `ROOT` is the repository root (the cwd
and PYTHONPATH a child process needs to import the project)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["ROOT", "swarm"]

ROOT = Path(__file__).resolve().parents[2]


def swarm(
    *args: str, timeout: float = 300, env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """`python -m swarm.cli ARGS` with `env` added; with `check`, it must exit 0."""
    result = subprocess.run(
        [sys.executable, "-m", "swarm.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    if check:
        assert result.returncode == 0, f"{args}: {result.stdout[-2000:]}{result.stderr[-3000:]}"
    return result
