"""The device check's quick run (CI's, on a CPU) forks its stage servers from a server that
imported torch once (`tests.support.forked`, as the test suite starts its own), instead of a
fresh interpreter each: a stage server's start is mostly torch's import, and the quick run's
parts start 16 of them side by side on a 2-core machine. bench/gpu_check.py asks for it with
GPU_CHECK_FORKED=1 in --quick runs on a CPU only: a GPU host's run starts each one as a user
does. bench/gpu_ratio.py (the smoke and ratio parts) never forks its servers: its CPU pass is
the device's (issue 63), and a forked server is its fork server's child, outside the run's
process group that ends it (bench/process_groups.py)."""

from __future__ import annotations

import os

ASK = "GPU_CHECK_FORKED"


def use_if_asked() -> None:
    """Stage servers from here on are forked (`swarm.local.procs.launcher`) when `ASK` is 1."""
    if os.environ.get(ASK) == "1":
        from swarm.local import procs
        from tests.support import forked

        procs.launcher = forked.launch
