"""NVIDIA's Multi-Process Service for bench/gpu_ratio.py's `--mps` A/B: the swarm run again with
the MPS control daemon running, so the stage servers' kernels share the GPU at once rather than
by time-slicing (docs/deployment.md, "Several stage servers on one GPU").

The daemon gets its own pipe and log directories under the bench's work directory (never the
host's default ones, which another user's daemon may hold): only processes started with
`CUDA_MPS_PIPE_DIRECTORY` pointing there (the phase and the servers it starts) become its
clients. It is quit after the run. Where the host cannot run it (no CUDA device asked, no
`nvidia-cuda-mps-control`, a daemon that will not start: a GPU in an exclusive compute mode, no
permission), the bench says "not available" and why, and measures without it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

__all__ = ["mps_daemon", "mps_unavailable"]

CONTROL = "nvidia-cuda-mps-control"


class MpsUnavailable(RuntimeError):
    """The daemon would not start here: the message says why."""


def mps_unavailable(device: str) -> str | None:
    """None when this host can try MPS for `device`; else why not."""
    if not device.startswith("cuda"):
        return f"not available: {device} is not a CUDA device"
    if shutil.which(CONTROL) is None:
        return f"not available: {CONTROL} is not on this host's PATH"
    return None


@contextlib.contextmanager
def mps_daemon(work: Path) -> Iterator[dict[str, str]]:
    """A daemon of its own under `work` while the body runs; yields the environment its clients
    need. Raises `MpsUnavailable` when it does not start."""
    control = shutil.which(CONTROL)
    if control is None:
        raise MpsUnavailable(f"{CONTROL} is not on this host's PATH")
    pipe, logs = work / "mps-pipe", work / "mps-log"
    pipe.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    extra = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs)}
    env = {**os.environ, **extra}
    try:
        subprocess.run([control, "-d"], env=env, check=True, timeout=30, capture_output=True)
    except (OSError, subprocess.SubprocessError) as e:
        raise MpsUnavailable(f"the daemon would not start: {e}") from e
    try:
        yield extra
    finally:
        subprocess.run([control], input="quit\n", text=True, env=env, timeout=60, check=False)
