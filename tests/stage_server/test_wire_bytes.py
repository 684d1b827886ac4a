"""Every stage server counts what it sends, on every data plane: real stage servers on real ports,
a real trainer, their /metrics scraped. A stage's outputs cross to the next stage either as a
Forward's reply (the carry plane) or as its own Push on to the next stage (the push plane); its
input gradient goes back as a reply on both. Whichever way, the sender counts it."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from client.standalone import train_standalone
from stage_server.server import RunningStageServer, StageServerOptions, start_stage_server
from swarm.job.config import JobConfig
from swarm.rpc.lease import Replica
from tests.support.jobs import make_job

STAGES, STEPS = 3, 2


def _job(tmp_path: Path, plane: str, wire: str = "none") -> JobConfig:
    return make_job(
        tmp_path,
        training={"stages": STAGES, "steps": STEPS, "dtype": "float32"},
        runtime={"data_plane": plane},
        compression={"wire": wire},
    )


@pytest.fixture
async def trained(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[JobConfig, list[dict[str, float]]]]:
    """The job trained `STEPS` steps on one stage server per stage (`request.param`: the data
    plane), and each server's counters after it, by series (name and labels)."""
    job = _job(tmp_path, request.param)
    servers: list[RunningStageServer] = []
    try:
        for stage in range(STAGES):
            options = StageServerOptions(stage=stage, metrics_port=0)
            servers.append(await start_stage_server(job, options))
        replicas = [[Replica(s.address, s.address)] for s in servers]
        await train_standalone(job, replicas)
        yield job, [await asyncio.to_thread(_scrape, s.metrics_port) for s in servers]
    finally:
        for s in servers:
            await s.stop()


def _scrape(port: int | None) -> dict[str, float]:
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    series = re.findall(r"^(swarm_stage_\w+)\{([^}]*)\} (\S+)$", text, re.M)
    return {f"{name}{{{_direction(labels)}}}": float(v) for name, labels, v in series}


def _direction(labels: str) -> str:
    found = re.search(r'direction="(\w+)"', labels)
    return found[1] if found else ""


def _boundary_bytes(job: JobConfig) -> int:
    """The float32 activations (or their gradient) of every training microbatch at one
    boundary: `[microbatch, seq, d_model]` each."""
    m, t = job.training, job.model
    return STEPS * m.microbatches_per_step * m.microbatch_size * t.seq_len * t.d_model * 4


@pytest.mark.parametrize("trained", ["push", "relay"], indirect=True)
async def test_every_stage_counts_what_it_sends(
    trained: tuple[JobConfig, list[dict[str, float]]],
) -> None:
    job, counted = trained
    each = _boundary_bytes(job)
    sent = [c.get("swarm_stage_wire_bytes_sent_total{}", 0.0) for c in counted]
    # Stage 0 sends its outputs on (no gradient back: nothing is before it); the middle stage
    # its outputs on and its input gradient back; the last stage its input gradient back.
    assert sent == [each, 2 * each, each], sent
    # The same, per boundary and direction, with the tokens they carried.
    tokens = each // (job.model.d_model * 4)
    forward, backward = ([each, each, 0], [0, each, each])
    for name, want in (("forward", forward), ("backward", backward)):
        got = [c.get(f"swarm_stage_boundary_bytes_sent_total{{{name}}}", 0.0) for c in counted]
        assert got == want, (name, got)
        got = [c.get(f"swarm_stage_boundary_tokens_sent_total{{{name}}}", 0.0) for c in counted]
        assert got == [tokens if w else 0 for w in want], (name, got)


@pytest.mark.parametrize("trained", ["push"], indirect=True)
async def test_a_pushing_stage_counts_the_gradient_it_gets_back(
    trained: tuple[JobConfig, list[dict[str, float]]],
) -> None:
    """On the push plane the gradient of a stage's outputs comes back in its own call's
    answer: received there, as the carry plane's comes in a request."""
    job, counted = trained
    each = _boundary_bytes(job)
    m, t = job.training, job.model
    # What each stage's request brought: its inputs (stage 0: the token ids) and the targets,
    # int64 `[microbatch, seq]` each, which travel along to the last stage.
    ids = STEPS * m.microbatches_per_step * m.microbatch_size * t.seq_len * 8
    received = [c.get("swarm_stage_wire_bytes_received_total{}", 0.0) for c in counted]
    assert received == [2 * ids + each, ids + 2 * each, ids + each], received
