"""Starting and stopping swarm processes on this machine: the demo, the benchmarks and the tests
use these, so every one of them waits on the same ready line and cleans up the same way."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["SwarmProcess", "start_process", "start_stage_servers", "stop_all"]

_READY = re.compile(r"swarm [\w-]+ ready: (.*)$")


@dataclass
class SwarmProcess:
    """A child process started with `swarm <args>`; its output goes to `log_path`."""

    args: list[str]
    proc: subprocess.Popen[bytes]
    log_path: Path
    ready: dict[str, str] = field(default_factory=dict)  # key=value pairs of its ready line

    @property
    def address(self) -> str:
        return self.ready["address"]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log().splitlines():
                match = _READY.search(line)
                if match:
                    self.ready = dict(
                        kv.split("=", 1) for kv in match.group(1).split() if "=" in kv
                    )
                    return self.ready
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"swarm {' '.join(self.args)} exited with {self.proc.returncode}:"
                    f"\n{self.log()[-3000:]}"
                )
            time.sleep(0.05)
        raise TimeoutError(
            f"swarm {' '.join(self.args)} not ready after {timeout}s:\n{self.log()[-3000:]}"
        )

    def kill(self) -> None:
        """SIGKILL: the process gets no chance to say goodbye."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, grace: float = 15.0) -> int:
        """SIGTERM, then SIGKILL after `grace` seconds."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode


def start_process(
    args: list[str],
    *,
    log_dir: Path | None = None,
    name: str = "swarm",
    env: dict[str, str] | None = None,
) -> SwarmProcess:
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="swarm-"))
    log_path = log_dir / f"{name}.log"
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "swarm.cli", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=child_env,
        )
    return SwarmProcess(args, proc, log_path)


def start_stage_servers(
    job_path: Path,
    stages: int,
    *,
    log_dir: Path | None = None,
    device: str = "cpu",
    threads: int = 1,
    metrics: bool = True,
    extra: list[str] | None = None,
    timeout: float = 120.0,
) -> list[SwarmProcess]:
    """One stage server per stage on free ports; returns once all are serving."""
    procs: list[SwarmProcess] = []
    try:
        for k in range(stages):
            args = [
                "stage-server",
                "--job",
                str(job_path),
                "--stage",
                str(k),
                "--port",
                "0",
                "--device",
                device,
                "--threads",
                str(threads),
                *(extra or []),
            ]
            if metrics:
                args += ["--metrics-port", "0"]
            procs.append(start_process(args, log_dir=log_dir, name=f"stage{k}"))
        for p in procs:
            p.wait_ready(timeout)
    except BaseException:
        stop_all(procs)
        raise
    return procs


def stop_all(procs: list[SwarmProcess], grace: float = 15.0) -> None:
    for p in procs:
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
