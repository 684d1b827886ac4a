"""A role process hands the GIL over after `swarm.ops.gil.SWITCH_S`, not Python's 5 ms (issue 69:
measured faster on the peer workload), set by `swarm.cli.entry`, the command's own start."""

from __future__ import annotations

import subprocess
import sys

import pytest

from swarm.ops.gil import SWITCH_S

# `swarm.cli.entry` with its `main` reading the switch interval the process runs with.
_ENTRY = """
import sys
from swarm import cli
cli.main = lambda argv=None: print(sys.getswitchinterval()) or 0
cli.entry()
"""


def test_the_swarm_commands_processes_hold_the_gil_longer() -> None:
    assert SWITCH_S > 0.005  # longer than Python's own
    done = subprocess.run(
        [sys.executable, "-c", _ENTRY], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    # Python keeps the interval in whole microseconds
    assert float(done.stdout.split()[-1]) == pytest.approx(SWITCH_S, abs=1e-6)
