"""Every stage server counts what it sends, on every data plane: real stage servers on real ports,
a real trainer, their /metrics scraped. A stage's outputs cross to the next stage either as a
Forward's reply (the carry plane) or as its own Push on to the next stage (the push plane, with
the targets, and a subspace boundary's token ids, beside them); its input gradient goes back as
a reply on both. Whichever way, the sender counts it."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from client.standalone import train_standalone
from stage_server.server import RunningStageServer, StageServerOptions, start_stage_server
from swarm.job.config import JobConfig
from swarm.rpc.lease import Replica
from swarm.wire import codec
from tests.support.jobs import make_job

STAGES, STEPS = 3, 2


RANK = 4  # the subspace case's `model.boundary_rank`


def _job(tmp_path: Path, plane: str, wire: str = "none", rank: int = 0) -> JobConfig:
    return make_job(
        tmp_path,
        model={"boundary_rank": rank} if rank else {},
        training={"stages": STAGES, "steps": STEPS, "dtype": "float32"},
        runtime={"data_plane": plane},
        compression={"wire": wire},
    )


@pytest.fixture
async def trained(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[JobConfig, list[dict[str, float]]]]:
    """The job trained `STEPS` steps on one stage server per stage (`request.param`: the data
    plane, or the plane, the wire codec and the boundary rank), and each server's counters
    after it, by series (name and labels)."""
    param = request.param
    job = _job(tmp_path, *(param if isinstance(param, tuple) else (param,)))
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


def _ids_bytes(job: JobConfig) -> int:
    """The int64 targets (or token ids) `[microbatch, seq]` of every training microbatch."""
    m, t = job.training, job.model
    return STEPS * m.microbatches_per_step * m.microbatch_size * t.seq_len * 8


@pytest.mark.parametrize("trained", ["push", "relay"], indirect=True)
async def test_every_stage_counts_what_it_sends(
    trained: tuple[JobConfig, list[dict[str, float]]],
) -> None:
    job, counted = trained
    each = _boundary_bytes(job)
    # On the push plane a stage passes the targets (int64 `[microbatch, seq]`) on beside its
    # outputs: they cross the same link, and their sender counts them as sent too.
    ids = _ids_bytes(job) if job.runtime.data_plane == "push" else 0
    sent = [c.get("swarm_stage_wire_bytes_sent_total{}", 0.0) for c in counted]
    # Stage 0 sends its outputs on (no gradient back: nothing is before it); the middle stage
    # its outputs on and its input gradient back; the last stage its input gradient back.
    assert sent == [each + ids, 2 * each + ids, each], sent
    # The boundary tensors alone, per boundary and direction, with the tokens they carried.
    tokens = each // (job.model.d_model * 4)
    forward, backward = ([each, each, 0], [0, each, each])
    for name, want in (("forward", forward), ("backward", backward)):
        got = [c.get(f"swarm_stage_boundary_bytes_sent_total{{{name}}}", 0.0) for c in counted]
        assert got == want, (name, got)
        got = [c.get(f"swarm_stage_boundary_tokens_sent_total{{{name}}}", 0.0) for c in counted]
        assert got == [tokens if w else 0 for w in want], (name, got)


@pytest.mark.parametrize("trained", [("push", "hadamard3", RANK)], indirect=True)
async def test_a_subspace_boundary_sends_its_coefficients_in_the_codec_and_the_ids_beside(
    trained: tuple[JobConfig, list[dict[str, float]]],
) -> None:
    """`model.boundary_rank` and a codec stack: r coefficients per token cross, each in
    `hadamard3`, forward and backward; beside them the targets and the narrow token ids, which
    their sender counts as sent, not as the boundary's."""
    job, counted = trained
    m, t = job.training, job.model
    microbatches = STEPS * m.microbatches_per_step
    zeros = torch.zeros(m.microbatch_size, t.seq_len, RANK)
    one = codec.encode(zeros, "inputs", codec.codec_from_name("hadamard3"))
    coefficients = microbatches * one.nbytes
    assert coefficients < _boundary_bytes(job) * RANK / t.d_model / 8  # the ratios multiply
    got = [c.get("swarm_stage_boundary_bytes_sent_total{forward}", 0.0) for c in counted]
    assert got == [coefficients, coefficients, 0], got
    got = [c.get("swarm_stage_boundary_bytes_sent_total{backward}", 0.0) for c in counted]
    assert got == [0, coefficients, coefficients], got
    tokens = microbatches * m.microbatch_size * t.seq_len
    got = [c.get("swarm_stage_boundary_tokens_sent_total{forward}", 0.0) for c in counted]
    assert got == [tokens, tokens, 0], got
    # The targets and the token ids, each as uint8 (a byte vocabulary), not int64's 8 bytes.
    beside = 2 * (_ids_bytes(job) // 8)
    sent = [c.get("swarm_stage_wire_bytes_sent_total{}", 0.0) for c in counted]
    want = [coefficients + beside, 2 * coefficients + beside, coefficients]
    assert sent == want, sent


@pytest.mark.parametrize("trained", ["push"], indirect=True)
async def test_a_pushing_stage_counts_the_gradient_it_gets_back(
    trained: tuple[JobConfig, list[dict[str, float]]],
) -> None:
    """On the push plane the gradient of a stage's outputs comes back in its own call's
    answer: received there, as the carry plane's comes in a request."""
    job, counted = trained
    each = _boundary_bytes(job)
    # What each stage's request brought: its inputs (stage 0: the token ids) and the targets,
    # int64 `[microbatch, seq]` each, which travel along to the last stage.
    ids = _ids_bytes(job)
    received = [c.get("swarm_stage_wire_bytes_received_total{}", 0.0) for c in counted]
    assert received == [2 * ids + each, ids + 2 * each, ids + each], received
    # Every byte a server received was counted as sent by a server, or sent by the trainer
    # (stage 0's token ids and targets): none crossed a boundary uncounted.
    sent = [c.get("swarm_stage_wire_bytes_sent_total{}", 0.0) for c in counted]
    assert sum(sent) + 2 * ids == sum(received), (sent, received)
