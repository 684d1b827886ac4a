"""The suite's reaper (`tests.support.reaper`): a test failed by pytest-timeout while it waits in
`subprocess.run` leaves nothing running. `subprocess.run` SIGKILLs the process it started and
nothing else; before, that process's own children (a `swarm demo`'s scheduler and stage servers)
went to init and ran on after the suite. Here a pytest of its own, with the suite's reaper, runs
one such test, and the grandchild it leaves is gone when that pytest ends."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.support.cli import ROOT
from tests.support.waiting import wait_until_blocking

# The process the hung test waits on: it starts a child of its own, says its pid, and hangs.
PARENT = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(sys.argv[1] + ".part", "w") as f:
    f.write(str(child.pid))
os.rename(sys.argv[1] + ".part", sys.argv[1])
time.sleep(600)
"""

# The hung test: it waits in `subprocess.run`, and pytest-timeout fails it once the grandchild
# is there (its own alarm, armed sooner than the ini's timeout: SIGALRM, as on expiry).
HUNG = f"""
import os, signal, subprocess, sys, threading, time
from pathlib import Path

PARENT = {PARENT!r}

def test_hangs_in_subprocess_run():
    said = Path(os.environ["REAPER_PID_FILE"])

    def alarm_once_started():
        while not said.exists():
            time.sleep(0.01)
        signal.setitimer(signal.ITIMER_REAL, 0.1)

    threading.Thread(target=alarm_once_started, daemon=True).start()
    subprocess.run([sys.executable, "-c", PARENT, str(said)], timeout=600)
"""


def _gone(pid: int) -> bool:
    """No such process, or one that is dead and waits to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def test_a_test_failed_by_pytest_timeout_leaves_no_orphan_running(tmp_path: Path) -> None:
    inner = tmp_path / "inner"
    inner.mkdir()
    (inner / "pytest.ini").write_text("[pytest]\ntimeout = 120\n")
    (inner / "conftest.py").write_text("from tests.support.reaper import kill_leftovers  # noqa\n")
    (inner / "test_hung.py").write_text(HUNG)
    said = tmp_path / "grandchild.pid"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env |= {"PYTHONPATH": str(ROOT), "REAPER_PID_FILE": str(said)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(inner)],
        cwd=inner,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    output = done.stdout + done.stderr
    orphan = int(said.read_text())
    try:
        assert "Timeout" in output and "1 failed" in output, output
        # killed after the test, before that pytest ended (a moment for SIGKILL to land)
        wait_until_blocking(lambda: _gone(orphan), f"the orphan {orphan} gone", timeout_s=10)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(orphan, signal.SIGKILL)
