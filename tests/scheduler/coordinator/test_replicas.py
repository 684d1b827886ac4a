"""The scheduler's replica connections: what a state downloaded from a replica is checked against
(`StateChecks`, the stage's layout built on the meta device) is built off the event loop, once per
stage of a job, and shared by the stage's replicas. Built on the loop, a 4096-layer job's took
9.7 s, the scheduler, its job API and embedded broker frozen meanwhile."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import scheduler.coordinator.replicas as replicas
from scheduler.coordinator.replicas import grpc_replicas
from swarm.job.config import JobConfig
from swarm.rpc.lease import Replica
from swarm.rpc.stage_client import StageClient
from tests.support.jobs import make_job


async def test_state_checks_are_built_off_the_event_loop_once_per_stage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = make_job(tmp_path, training={"stages": 2})
    built: list[tuple[int, threading.Thread]] = []

    def watched(job: JobConfig, stage: int) -> SimpleNamespace:
        built.append((stage, threading.current_thread()))
        return SimpleNamespace(stage=stage)  # a stand-in: the real ones take seconds to warm up

    expected: list[tuple[int, Any]] = []

    async def download_state(
        self: StageClient,
        include_optimizer: bool = False,
        prefix: str = "param/",
        follower: str = "",
        *,
        expect: Any,
    ) -> tuple[int, dict[str, torch.Tensor]]:
        expected.append((self.stage, expect))
        return 3, {}

    monkeypatch.setattr(replicas, "StateChecks", watched)
    monkeypatch.setattr(StageClient, "download_state", download_state)  # no replica to ask
    connect = grpc_replicas(job, "job")
    # Two replicas of each stage (a checkpoint, an export, a recovery all download).
    clients = [
        connect(k, Replica(f"p{k}{i}", f"127.0.0.1:{9000 + 2 * k + i}"))
        for k in (0, 1)
        for i in (0, 1)
    ]
    try:
        for _ in range(2):  # the first downloads at once, then again
            got = await asyncio.gather(*(c.download_state(True, prefix="") for c in clients))
            assert got == [(3, {})] * 4
    finally:
        await asyncio.gather(*(c.close() for c in clients))
    assert sorted(stage for stage, _ in built) == [0, 1], built  # once per stage
    assert all(t is not threading.main_thread() for _, t in built), built  # never on the loop
    assert len(expected) == 8
    for k in (0, 1):  # one StateChecks per stage, shared by its replicas
        checks = {id(e) for stage, e in expected if stage == k}
        assert len(checks) == 1
        assert next(e for stage, e in expected if stage == k).stage == k
