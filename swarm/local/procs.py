"""Starting and stopping swarm processes on this machine: the demo, the benchmarks and the tests
use these, so every one of them waits on the same ready line and cleans up the same way."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Protocol

from swarm.ops.lifecycle import parse_ready

__all__ = [
    "Child",
    "Launcher",
    "LocalSwarm",
    "SwarmProcess",
    "spawn",
    "start_local_swarm",
    "start_process",
    "start_stage_servers",
    "stop_all",
]


class Child(Protocol):
    """A started process, as `subprocess.Popen` is one."""

    @property
    def pid(self) -> int: ...
    @property
    def returncode(self) -> int | None: ...
    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def kill(self) -> None: ...
    def send_signal(self, sig: int) -> None: ...


class Launcher(Protocol):
    """Runs `swarm <args>` as a process of its own, its stdout and stderr into `out`."""

    def __call__(self, args: list[str], out: BinaryIO, env: dict[str, str]) -> Child: ...


def spawn(args: list[str], out: BinaryIO, env: dict[str, str]) -> Child:
    """A fresh interpreter: `python -m swarm.cli ARGS`."""
    return subprocess.Popen(
        [sys.executable, "-m", "swarm.cli", *args],
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
    )


launcher: Launcher = spawn
"""How `start_process` starts processes. The test suite, which starts hundreds, forks them from
a server that imported torch once (`tests.support.forked`)."""


@dataclass
class SwarmProcess:
    """A child process started with `swarm <args>`; its output goes to `log_path`."""

    args: list[str]
    proc: Child
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
                fields = parse_ready(line)
                if fields is not None:
                    self.ready = fields
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
                return self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.wait()


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
        proc = launcher(args, out, child_env)
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


@dataclass
class LocalSwarm:
    """A scheduler and joining stage servers on this machine, each its own process."""

    scheduler: SwarmProcess
    peers: list[SwarmProcess]
    log_dir: Path
    env: dict[str, str]

    @property
    def address(self) -> str:
        return self.scheduler.address

    @property
    def broker(self) -> str:
        return self.scheduler.ready["broker"]

    def add_peer(
        self,
        throttle: float = 1.0,
        threads: int = 1,
        timeout: float = 120.0,
        extra: list[str] | None = None,
    ) -> SwarmProcess:
        return self.add_peers([throttle], threads, timeout, extra)[0]

    def add_peers(
        self,
        throttles: list[float],
        threads: int = 1,
        timeout: float = 120.0,
        extra: list[str] | None = None,
        envs: list[dict[str, str]] | None = None,
    ) -> list[SwarmProcess]:
        """One stage server per throttle, all started before any is waited for: each one's
        start (an interpreter, torch's import, its servers, the broker) is its own, and five
        started one after another took five starts' time. Started together they share the
        machine, so the wait is `timeout` per peer for all of them, as it was one by one.
        `envs`: each peer's variables over the swarm's (`SWARM_HOST_ID`: a machine of its own)."""
        each = envs or [{} for _ in throttles]  # as many as throttles (zip's strict says so)
        started = [
            self._start_peer(throttle, threads, extra, env)
            for throttle, env in zip(throttles, each, strict=True)
        ]
        deadline = time.monotonic() + timeout * len(started)
        for peer in started:
            peer.wait_ready(max(deadline - time.monotonic(), 0.1))
        return started

    def _start_peer(
        self,
        throttle: float,
        threads: int,
        extra: list[str] | None,
        env: dict[str, str] | None = None,
    ) -> SwarmProcess:
        n = len(self.peers)
        peer = start_process(
            [
                "stage-server",
                "--broker",
                self.broker,
                "--port",
                "0",
                "--metrics-port",
                "0",
                "--throttle",
                str(throttle),
                "--threads",
                str(threads),
                "--peer",
                f"peer{n}",
                "--scheduler",  # where a starting checkpoint not at its path is fetched from
                self.address,
                *(extra or []),
            ],
            log_dir=self.log_dir,
            name=f"peer{n}",
            env={**self.env, **(env or {})},
        )
        self.peers.append(peer)
        return peer

    def restart_scheduler(self, args: list[str], timeout: float = 60.0) -> SwarmProcess:
        self.scheduler = start_process(
            args, log_dir=self.log_dir, name="scheduler-restarted", env=self.env
        )
        self.scheduler.wait_ready(timeout)
        return self.scheduler

    def stop(self, grace: float = 15.0) -> None:
        stop_all(self.peers, grace)
        stop_all([self.scheduler], grace)


def start_local_swarm(
    throttles: list[float],
    *,
    log_dir: Path,
    broker: str | None = None,
    extra_scheduler: list[str] | None = None,
    env: dict[str, str] | None = None,
    threads: int = 1,
    timeout: float = 120.0,
    data_root: Path | None = None,
    dial_private: bool = True,
) -> tuple[LocalSwarm, list[str]]:
    """Start a scheduler (with an embedded broker unless `broker` is given) and one stage server
    per throttle. Returns the swarm and the scheduler's command line (to restart it). Jobs may
    name data files under `data_root` only (None: an empty directory of the swarm's own).
    `dial_private`: its dial-back may dial this machine's loopback, where its peers are (the
    scheduler's --dial-private)."""
    env = {"SWARM_CACHE_DIR": str(log_dir / "cache"), **(env or {})}
    if data_root is None:
        data_root = log_dir / "data"
        data_root.mkdir(parents=True, exist_ok=True)
    args = [
        "--log-level",
        "INFO",
        "scheduler",
        "--port",
        "0",
        "--metrics-port",
        "0",
        "--store",
        str(log_dir / "jobs.sqlite"),
        "--checkpoint-dir",
        str(log_dir / "ckpt"),
        "--data-root",
        str(data_root),
        *(["--dial-private"] if dial_private else []),
        *(["--broker", broker] if broker else []),
        *(extra_scheduler or []),
    ]
    scheduler = start_process(args, log_dir=log_dir, name="scheduler", env=env)
    swarm = LocalSwarm(scheduler, [], log_dir, env)
    try:
        scheduler.wait_ready(timeout)
        swarm.add_peers(list(throttles), threads, timeout)
    except BaseException:
        swarm.stop()
        raise
    return swarm, args
