"""Run `swarm ...` as its own process, as a user would; `ROOT` is the repository root (the cwd
and PYTHONPATH a child process needs to import the project). `swarm` starts a fresh interpreter
(what a command's own start, its flags and exit status, is tested by); `swarm_forked` forks one
from the suite's fork server, for a command that does torch work (`swarm local`, `swarm trainer`):
a fresh interpreter spends seconds of CPU importing torch first (`tests.support.forked`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from swarm.local.procs import start_process

__all__ = ["ROOT", "swarm", "swarm_forked"]

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


def swarm_forked(
    *args: str,
    log_dir: Path,
    name: str,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> tuple[int, str]:
    """`swarm ARGS` to its end, a process of its own (`swarm.local.procs.start_process`) with
    `env` added, its output in `log_dir/NAME.log`: its exit status and that output (stdout and
    stderr together). With `check` it must exit 0; past `timeout` it is killed and fails."""
    process = start_process(list(args), log_dir=log_dir, name=name, env=env)
    try:
        code = process.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        raise AssertionError(
            f"{args}: not done in {timeout:g} s:\n{process.log()[-3000:]}"
        ) from None
    if check:
        assert code == 0, f"{args} exited with {code}:\n{process.log()[-3000:]}"
    return code, process.log()
