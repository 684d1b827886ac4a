"""The views live through a scheduler that does not answer (issue 51, item 4): `swarm submit
--wait` and `swarm status --watch`, each its own process, against a real scheduler process that
is first stopped (SIGSTOP: its connections stay open and nothing answers, as in a home network
blip) and then killed and restarted on the same port and store. Both say "scheduler unreachable
since ...: retrying", go on once it answers, and end only when the job does."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from swarm.local.procs import SwarmProcess, start_local_swarm, start_process
from tests.support.cli import swarm
from tests.support.jobs import write_job
from tests.support.waiting import wait_until_blocking

pytestmark = pytest.mark.slow

UNREACHABLE = "scheduler unreachable since "
BACK = "scheduler answers again"


def _says(proc: SwarmProcess, text: str, times: int = 1) -> bool:
    """Whether `proc` has said `text` `times` times; a process that exited fails at once."""
    log = proc.log()
    if log.count(text) >= times:
        return True
    if proc.proc.poll() is not None:
        raise AssertionError(f"swarm {' '.join(proc.args)} exited:\n{log[-3000:]}")
    return False


def _outages(proc: SwarmProcess) -> int:
    """How many outages `proc` has shown: each says the time it began, and the progress bar
    redraws an outage's words more than once (after the scheduler answers again, too), so the
    words' count is no count of outages."""
    log = proc.log()
    if proc.proc.poll() is not None:
        raise AssertionError(f"swarm {' '.join(proc.args)} exited:\n{log[-3000:]}")
    return len(set(re.findall(rf"{UNREACHABLE}(\d\d:\d\d:\d\d) ", log)))


def _outage_s(proc: SwarmProcess) -> int:
    """The longest outage `proc` has shown, in seconds."""
    return max(map(int, re.findall(r"\((\d+) s\): retrying", proc.log())), default=0)


def test_wait_and_watch_keep_going_through_a_stopped_and_a_restarted_scheduler(
    tmp_path: Path,
) -> None:
    sw, args = start_local_swarm([], log_dir=tmp_path)  # no peers: the job waits, placing
    port = sw.address.rsplit(":", 1)[1]
    fast = ["--scheduler", sw.address, "--timeout", "1"]  # an unanswered ask fails in 1 s
    views: list[SwarmProcess] = []
    try:
        job_file = write_job(tmp_path, "blip")
        waiter = start_process(
            ["submit", str(job_file), "--wait", "--poll", "0.2", *fast],
            log_dir=tmp_path,
            name="waiter",
            env=sw.env,
        )
        views.append(waiter)
        job = wait_until_blocking(
            lambda: next((w for w in waiter.log().split() if w.startswith("blip-")), None),
            "the job's id from `swarm submit --wait`",
            timeout_s=60,
        )
        watcher = start_process(
            ["status", job, "--watch", "--interval", "0.2", *fast],
            log_dir=tmp_path,
            name="watcher",
            env=sw.env,
        )
        views.append(watcher)
        wait_until_blocking(
            lambda: _says(watcher, f"job      {job}"), "a first frame", timeout_s=60
        )

        os.kill(sw.scheduler.proc.pid, signal.SIGSTOP)  # hung: asks time out, none is refused
        for view in views:
            wait_until_blocking(lambda v=view: _says(v, UNREACHABLE), f"{view.args[0]}: outage")
        # Asked again and again, the bar's count of the outage runs on in place.
        wait_until_blocking(lambda: _outage_s(waiter) >= 2, "the waiter: 2 s of it")
        os.kill(sw.scheduler.proc.pid, signal.SIGCONT)
        wait_until_blocking(lambda: _says(waiter, BACK), "the waiter: the scheduler is back")

        sw.scheduler.kill()  # gone: asks are refused at the port until it is back
        # Seen before the restart: a scheduler back before the waiter's next ask is no outage
        # to it, and it would have nothing to say "again" of.
        wait_until_blocking(lambda: _outages(waiter) >= 2, "the waiter: a second outage")
        same_port = [
            port if a == "0" and args[i - 1] == "--port" else a for i, a in enumerate(args)
        ]
        sw.restart_scheduler(same_port)  # the same port and store: the job is still there
        wait_until_blocking(lambda: _says(waiter, BACK, 2), "the waiter: the scheduler is back")

        swarm("cancel", job, "--scheduler", sw.address)
        # The views end with the job, not with the outage: exit 1 as any cancelled job's.
        for view in views:
            assert view.proc.wait(60) == 1
        assert f"swarm submit: error: job {job} cancelled at step 0" in waiter.log()
        assert f"swarm status: error: job {job} cancelled at step 0" in watcher.log()
        assert "did not answer in time" not in waiter.log() + watcher.log()
    finally:
        for view in views:
            view.kill()
        sw.stop()
