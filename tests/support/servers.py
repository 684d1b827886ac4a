"""Stage servers as their own processes for the fault tests (`Servers`: each named `s{stage}r{i}`,
with its faults, killable and restartable on its port), the job trained on them to its end
(`train_on`), and what the counters say (`counted`)."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from client.standalone import train_standalone
from swarm.deadline import within
from swarm.job.config import load_job
from swarm.local.procs import SwarmProcess, start_process, stop_all
from swarm.ops.faults import ENV, Fault, FaultPlan
from swarm.rpc.lease import Replica

__all__ = ["Servers", "counted", "train_on"]


class Servers:
    """Stage servers `s{stage}r{replica}`, each its own process, restartable on its port."""

    def __init__(
        self,
        job: Path,
        layout: list[int],
        faults: list[Fault],
        log_dir: Path,
        slow: frozenset[str] = frozenset(),
        device: str = "cpu",
        metrics: bool = False,
    ) -> None:
        """`faults`: each server's own (`SWARM_FAULTS`: killing, raising and hostile points);
        `metrics`: each serves /metrics (its port in `ready["metrics"]`)."""
        self.job, self.faults, self.log_dir, self.slow = job, faults, log_dir, slow
        self.extra = ["--device", device, *(["--metrics-port", "0"] if metrics else [])]
        self.procs: dict[str, SwarmProcess] = {}
        self.ports: dict[str, str] = {}
        self.layout = layout
        for stage, count in enumerate(layout):
            for r in range(count):
                self.start(f"s{stage}r{r}", stage)
        for p in self.procs.values():
            p.wait_ready(120)
        self.ports = {n: p.address.rsplit(":", 1)[1] for n, p in self.procs.items()}

    def start(self, name: str, stage: int, port: str = "0", faults: bool = True) -> SwarmProcess:
        env = {ENV: FaultPlan.for_process(self.faults, name) if faults else ""}
        self.procs[name] = start_process(
            [
                "--log-level",
                "INFO",
                "stage-server",
                "--job",
                str(self.job),
                "--stage",
                str(stage),
                "--port",
                port,
                "--throttle",
                "3" if name in self.slow else "1",
                *self.extra,
            ],
            log_dir=self.log_dir,
            name=f"{name}-{len(self.procs)}-{time.monotonic_ns()}",
            env=env,
        )
        return self.procs[name]

    def restart(self, name: str) -> None:
        stage = int(name[1:].split("r")[0])
        self.start(name, stage, self.ports[name], faults=False).wait_ready(120)

    def replicas(self) -> list[list[Replica]]:
        return [
            [Replica(f"s{k}r{r}", f"127.0.0.1:{self.ports[f's{k}r{r}']}") for r in range(n)]
            for k, n in enumerate(self.layout)
        ]

    def stop(self) -> None:
        stop_all(list(self.procs.values()))


def train_on(
    servers: Servers,
    on_step: object = None,
    checkpoint_dir: Path | None = None,
    routes: Path | None = None,
) -> tuple[dict[str, torch.Tensor], CollectorRegistry]:
    """The job to its end on `servers` (a standalone trainer and coordinator in this process,
    bounded at 300 s): its parameters, and the registry its counters went to."""
    registry = CollectorRegistry()
    job = load_job(servers.job)
    training = train_standalone(
        job,
        servers.replicas(),
        registry=registry,
        on_step=on_step,  # type: ignore[arg-type]
        checkpoint_dir=checkpoint_dir,
        routes=routes,
    )
    return asyncio.run(within(training, 300)), registry


def train_logged(
    servers: Servers, caplog: pytest.LogCaptureFixture
) -> tuple[dict[str, torch.Tensor], CollectorRegistry, list[str]]:
    """`train_on(servers)` with this process's warnings captured, the servers stopped after
    however it ended: its parameters, its registry, and what the log said."""
    try:
        with caplog.at_level(logging.WARNING):
            state, registry = train_on(servers)
    finally:
        servers.stop()
    return state, registry, [r.getMessage() for r in caplog.records]


def counted(registry: CollectorRegistry, name: str) -> float:
    """The sum of every sample of counter `name` in `registry`."""
    return sum(s.value for m in registry.collect() for s in m.samples if s.name == name)
