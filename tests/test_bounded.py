"""Nothing grows without bound over days of jobs and churn: each long-lived structure, after many
simulated peers (or jobs) come and go, holds only what is still present."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from client.metrics import TrainerMetrics
from client.trainer import SERIES_GRACE_S, PipelineTrainer
from scheduler.coordinator.metrics import CoordinatorFamilies, CoordinatorMetrics
from scheduler.registry import PeerRegistry
from stage_server import agent as agent_module
from stage_server.agent import PeerAgent
from stage_server.averaging.channels import ChannelPool
from swarm.bus.topics import Topics
from swarm.clock import FakeClock
from swarm.model.data import TextData, microbatch_seed
from swarm.proto import control_pb2 as cpb
from swarm.rpc.lease import Lease, Replica
from tests.support.jobs import BASE, make_job, render

pytestmark = pytest.mark.timeout(60)

CHURN = 50  # peers (or jobs) that come and go in each test


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t


# ------------------------------------------------------------------------------ data: bytes


def test_text_tokens_are_held_as_bytes(tmp_path: Path) -> None:
    text = bytes(range(256)) * 40
    path = tmp_path / "corpus.txt"
    path.write_bytes(text)
    data = TextData(path, seq_len=16, microbatch_size=4, seed=3)
    assert data.tokens.dtype == torch.uint8 and data.tokens.numel() == len(text)
    # The samples are what the int64 array gave: the same windows, int64 as the model takes.
    reference = torch.tensor(list(text), dtype=torch.int64)
    gen = torch.Generator().manual_seed(microbatch_seed(3, 5, 2))
    starts = torch.randint(0, len(text) - 17, (4,), generator=gen)
    rows = reference[starts[:, None] + torch.arange(17)[None, :]]
    inputs, targets = data.microbatch(5, 2)
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs, rows[:, :-1]) and torch.equal(targets, rows[:, 1:])


# -------------------------------------------------------------------------- scheduler registry


def test_registry_holds_only_present_peers() -> None:
    reg = PeerRegistry(_Clock(), load_silence_s=10.0, serve_timeout_s=10.0)
    for i in range(CHURN):
        peer = f"p{i}"
        reg.announce(cpb.PeerAnnouncement(peer=peer, job="j", state=cpb.PEER_STATE_JOINING))
        reg.assigned(peer, "j")
        reg.announce(
            cpb.PeerAnnouncement(peer=peer, job="j", stage=0, state=cpb.PEER_STATE_SERVING)
        )
        reg.report_load(cpb.LoadReport(peer=peer, job="j", stage=0, ema_seconds_per_sample=0.1))
        reg.announce(cpb.PeerAnnouncement(peer=peer, state=cpb.PEER_STATE_OFFLINE))
    assert reg.peers == {} and reg._loads == {} and reg._assigned_at == {}
    assert reg._unplaceable == set()


# ------------------------------------------------------------------------------------ trainer


class _NoLeases:
    async def lease(self, trainer: str, count: int) -> Lease:
        raise AssertionError("not used")


async def test_trainer_forgets_clients_and_series_of_departed_peers(tmp_path: Path) -> None:
    # replaced clients are closed after a call's deadline: a short one here
    job = make_job(tmp_path, training={"stages": 2}, runtime={"rpc_timeout_s": 0.01})
    clock = FakeClock()
    trainer = PipelineTrainer(
        job,
        _NoLeases(),  # type: ignore[arg-type]
        job_id="j",
        metrics=TrainerMetrics("j", registry=CollectorRegistry()),
        clock=clock,
    )

    def peers_with_series() -> set[str | None]:
        return {
            s.labels.get("peer")
            for family in trainer.metrics.registry.collect()
            for s in family.samples
            if "peer" in s.labels
        }

    keep = Replica("keep", "127.0.0.1:1", 1.0)
    for i in range(CHURN):
        peer = Replica(f"p{i}", f"127.0.0.1:{1000 + i}", 1.0)
        trainer.sync([[keep], [peer]])
        trainer.metrics.routed(1, peer.peer, 2.0)
        trainer.metrics.failed(1, peer.peer)
        clock.advance(SERIES_GRACE_S / 10)
    trainer.sync([[keep], []])
    assert set(trainer.clients) == {"keep"}
    # the series of peers gone for the grace are removed; the last few are still scraped
    assert f"p{CHURN - 1}" in peers_with_series() and len(peers_with_series()) <= 12
    clock.advance(SERIES_GRACE_S)
    trainer.sync([[keep], []])
    assert peers_with_series() <= {"keep"}
    await asyncio.sleep(0.1)
    assert not len(trainer._retiring)  # the departed peers' channels were closed
    await trainer.close()


def test_coordinator_series_of_an_ended_job_are_removed() -> None:
    registry = CollectorRegistry()
    families = CoordinatorFamilies(registry)
    for i in range(CHURN):
        metrics = CoordinatorMetrics(f"job{i}", families=families)
        metrics.replays.inc()
        metrics.last_commit.set(1.0)
        families.remove(f"job{i}")
    jobs = {s.labels.get("job") for f in registry.collect() for s in f.samples}
    assert jobs <= {None}


# ------------------------------------------------------------------------------- channel pool


async def test_channel_pool_closes_channels_to_peers_it_no_longer_talks_to() -> None:
    clock = _Clock()
    pool = ChannelPool(idle_s=60.0, clock=clock)
    pool.channel("127.0.0.1:1")  # a peer in every group
    for i in range(CHURN):
        clock.t += 30.0
        pool.channel("127.0.0.1:1")
        pool.channel(f"127.0.0.1:{1000 + i}")  # a peer in one group only, then gone
    assert len(pool) <= 4  # the groups of the last idle_s, not every peer ever
    await pool.close()
    assert len(pool) == 0


# ---------------------------------------------------------------------------------- the agent


class _Bus:
    topics = Topics()

    def __init__(self) -> None:
        self.published: list[tuple[str, Any]] = []

    async def publish(self, topic: str, message: Any, retain: bool = False) -> None:
        self.published.append((topic, message))


async def test_agent_forgets_jobs_that_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent_module, "measure_job", lambda *a: {0: 1.0, 1: 1.0})
    executor = ThreadPoolExecutor(1)
    running: Any = SimpleNamespace(
        address="127.0.0.1:1",
        executor=executor,
        servicer=SimpleNamespace(release=lambda: None, trust=lambda job: None),
    )
    agent = PeerAgent(running, _Bus(), peer="p", device="cpu")  # type: ignore[arg-type]
    spec = _spec()
    for i in range(CHURN):
        job = f"job{i}"
        await agent._on_job(cpb.JobAnnouncement(job=job, spec=spec, state=cpb.JOB_STATE_PLACING))
        await agent.settled()  # its take-up (fetched, measured) done
        assert agent.job_id == job
        await agent._on_job(cpb.JobAnnouncement(job=job, spec=spec, state=cpb.JOB_STATE_SUCCEEDED))
        assert agent.job_id == ""
    # jobs announced ended that this peer never took part in
    for i in range(CHURN):
        await agent._on_job(cpb.JobAnnouncement(job=f"old{i}", state=cpb.JOB_STATE_FAILED))
    executor.shutdown()
    assert len(agent._jobs) <= 1 and len(agent._active) == 0
    assert len(getattr(agent, "_ended", ())) <= getattr(agent_module, "ENDED_REMEMBERED", 0)


def _spec() -> str:
    return render({**BASE, "training": {**BASE["training"], "stages": 2}})


# ----------------------------------------------------------------------------------- peer id


def test_peer_id_is_stable_across_restarts_and_unique_per_process(tmp_path: Path) -> None:
    from stage_server.agent import persistent_peer_id

    first = persistent_peer_id(tmp_path)
    assert first.id and ":" not in first.id and "/" not in first.id
    first.release()
    again = persistent_peer_id(tmp_path)  # the process restarted
    assert again.id == first.id
    # a second stage server on the same machine (same cache) while the first runs
    other: list[str] = []

    def second() -> None:
        identity = persistent_peer_id(tmp_path)
        other.append(identity.id)
        identity.release()

    thread = threading.Thread(target=second)
    thread.start()
    thread.join()
    assert other and other[0] != again.id
    again.release()


def test_peer_id_given_on_the_command_line_wins(tmp_path: Path) -> None:
    from stage_server.agent import persistent_peer_id

    assert persistent_peer_id(tmp_path, given="alice").id == "alice"
    assert not list(tmp_path.iterdir())  # nothing written for a given id
