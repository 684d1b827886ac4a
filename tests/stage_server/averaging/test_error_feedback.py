"""Error feedback for lossy averaging: rounds on real gRPC replicas that carry what every encoding
dropped into the next round (so nothing is lost over many), and a replica's bookkeeping of its
residuals across aborted rounds, retries, steps and jobs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from scheduler.coordinator import LocalCoordinator
from stage_server.averaging.butterfly import RoundSettings, all_reduce
from stage_server.averaging.error_feedback import ErrorFeedback, Residuals
from stage_server.averaging.flat import split_parts
from stage_server.server import RunningStageServer
from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.ops.progress import StepRecord
from swarm.wire.codec import CODEC_INT8_BLOCKWISE
from tests.support.inprocess import Swarm
from tests.support.jobs import make_job
from tests.support.pools import JOB, MiB, Replica, assert_identical, replicas

N, NUMEL, BLOCK, ROUNDS = 2, 4000, 1000, 40
HALF_STEP = 1 / 254  # int8 absmax: half a quantization step, per unit of the block's largest value


def gradients() -> list[torch.Tensor]:
    """Every block holds one value of 1 and many under half a step: int8 absmax rounds those to
    zero, so without feedback they never arrive."""
    torch.manual_seed(0)
    flats = []
    for _ in range(N):
        g = torch.rand(NUMEL) * 2e-3 + 5e-4
        g[::BLOCK] = 1.0
        flats.append(g)
    return flats


async def one_round(
    pool: Sequence[Replica],
    flats: Sequence[torch.Tensor],
    residuals: Sequence[Residuals | None],
    round: str,
    group: Sequence[str] | None = None,
) -> list[Any]:
    group = list(group or [r.address for r in pool])
    calls = [
        all_reduce(
            f,
            RoundSettings(
                group=group,
                index=group.index(r.address),
                round=round,
                job=JOB,
                stage=0,
                timeout_s=2.0,
                chunk_bytes=4 * MiB,
                max_bytes=64 * MiB,
                codec=CODEC_INT8_BLOCKWISE,
                block_size=BLOCK,
            ),
            averager=r.averager,
            channels=r.channels,
            residuals=e,
        )
        for r, f, e in zip(pool, flats, residuals, strict=True)
    ]
    return await asyncio.gather(*calls, return_exceptions=True)


async def many_rounds(feedback: bool) -> tuple[torch.Tensor, list[Residuals]]:
    """ROUNDS rounds of the same gradients, as ROUNDS steps would make: their decoded sums added
    up, and each replica's residuals at the end (carried from round to round, as APPLY does)."""
    flats = gradients()
    residuals = [Residuals(torch.zeros(NUMEL), torch.zeros(NUMEL)) for _ in range(N)]
    total = torch.zeros(NUMEL, dtype=torch.float64)
    async with replicas(N) as pool:
        for k in range(ROUNDS):
            given = residuals if feedback else [None] * N
            total += assert_identical(await one_round(pool, flats, given, f"r{k}")).double()
    return total, residuals


async def test_what_the_codec_drops_comes_back_in_later_rounds() -> None:
    exact = ROUNDS * torch.stack(gradients()).double().sum(0)
    small = torch.ones(NUMEL, dtype=torch.bool)
    small[::BLOCK] = False

    plain, _ = await many_rounds(feedback=False)
    assert torch.equal(plain[small], torch.zeros_like(plain[small]))  # lost, every round

    fed, residuals = await many_rounds(feedback=True)
    # Nothing is lost: what the rounds delivered plus what the replicas still hold is the exact
    # total (float32 residuals and sums: rounding only).
    held = sum(r.sent.double() + r.summed.double() for r in residuals)
    assert torch.allclose(fed + held, exact, rtol=1e-5, atol=1e-4)
    # And what is held stays within half a step per encoding (each contribution and the sum),
    # however many rounds ran: the small values arrive, late by at most that.
    bound = (N * 1.0 + N * 1.0) * HALF_STEP * 1.05  # contributions of absmax ~1, sums of ~N
    assert float((fed - exact).abs().max()) <= bound
    assert float((plain - exact).abs().max()) > 10 * bound  # the test can tell them apart
    assert all(float(r.summed.abs().sum()) > 0 for r in residuals)  # each owner kept its part's


async def test_an_aborted_round_leaves_the_residuals_as_they_were() -> None:
    flats = gradients()
    async with replicas(N + 1) as pool:
        live, dead = list(pool[:N]), pool[N]
        group = [r.address for r in pool]
        await dead.server.stop(None)
        residuals = []
        for part in split_parts(NUMEL, N):  # a sum's residual lies over the part its owner owned
            summed = torch.zeros(NUMEL)
            summed[part] = 2e-3
            residuals.append(Residuals(torch.full((NUMEL,), 1e-3), summed))
        before = [(r.sent.clone(), r.summed.clone()) for r in residuals]
        results = await one_round(live, flats, residuals, "r0", group=group)
        assert all(isinstance(r, Exception) for r in results), results
        for r, (sent, summed) in zip(residuals, before, strict=True):
            assert torch.equal(r.sent, sent) and torch.equal(r.summed, summed)
        # The retry without the dead replica completes, and replaces them.
        total = assert_identical(await one_round(live, flats, residuals, "r1"))
        exact = torch.stack(flats).double().sum(0) + sum(s.double() + m.double() for s, m in before)
        held = sum(r.sent.double() + r.summed.double() for r in residuals)
        assert torch.allclose(total.double() + held, exact, rtol=1e-5, atol=1e-5)


def test_a_step_uses_the_residuals_of_the_step_it_follows_once_that_one_applied() -> None:
    feedback, flat = ErrorFeedback(), torch.zeros(8)

    def held(step: int, job: str = "j", stage: int = 1, like: torch.Tensor = flat) -> float:
        r = feedback.start(job, stage, step, like)
        return float(r.sent.sum() + r.summed.sum())

    assert held(0) == 0.0
    feedback.prepared("j", 1, 4, Residuals(torch.ones(8), torch.ones(8)))
    assert held(5) == 0.0  # prepared, not applied: a retried round of step 4 starts from zeros
    feedback.prepared("j", 1, 4, Residuals(torch.full((8,), 2.0), torch.ones(8)))  # the retry
    feedback.applied("j", 1, 3)  # another step's APPLY commits nothing
    assert held(5) == 0.0
    feedback.applied("j", 1, 4)
    assert held(5) == 24.0  # the retry's, not the aborted round's
    start = feedback.start("j", 1, 5, flat)
    start.sent = torch.zeros(8)  # as a round that completed replaces it: what is held stays
    assert held(5) == 24.0
    # Only the step right after, on the same job, stage and gradient: a rollback, a move, a
    # restart or another model start from none.
    assert held(6) == held(4) == 0.0
    assert held(5, job="k") == held(5, stage=2) == 0.0
    assert held(5, like=torch.zeros(9)) == held(5, like=torch.zeros(8, dtype=torch.float64)) == 0.0


@pytest.mark.parametrize("codec", ["int8_blockwise", "none"])
async def test_pools_with_feedback_stay_identical_and_carry_each_applied_step(
    tmp_path: Path, make_swarm: list[Swarm], codec: str
) -> None:
    job = make_job(
        tmp_path,
        training={"steps": 4, "target_batch_size": 16},
        compression={"averaging": codec, "block_size": 64},
    )
    assert job.compression.error_feedback
    swarm = Swarm(job)
    make_swarm.append(swarm)
    await swarm.add_replicas(2)
    records: list[StepRecord] = []
    before: dict[str, float] = {}  # replica -> samples it had accumulated by the last step
    carried: dict[str, bool] = {}  # replica -> whether it held residuals after the last step

    def samples(server: RunningStageServer) -> float:
        metrics = server.servicer.metrics
        value = metrics.registry.get_sample_value("swarm_stage_samples_total", metrics.values)
        return value or 0.0

    def after_step(record: StepRecord) -> None:
        swarm.assert_replicas_identical()  # bitwise, whatever each replica holds back
        feedbacks = [s.servicer._feedback for stage in swarm.servers for s in stage]
        if codec == "none":  # exact averaging drops nothing: nothing held, nothing allocated
            assert all(f._applied is f._prepared is None for f in feedbacks)
            records.append(record)
            return
        applied = [f._applied for f in feedbacks]
        assert all(a is not None and a.step == record.step for a in applied), applied
        # A replica's encodings dropped something exactly when it had values to send: a gradient
        # of its own this step, or what the last step's encodings dropped (carried into this
        # round even when it accumulated nothing). The wiring may give one replica of a pool
        # every microbatch of a step (under load it does); one with neither holds nothing back.
        replicas = [s for stage in swarm.servers for s in stage]
        took = [samples(s) - before.get(s.address, 0.0) for s in replicas]
        before.update({s.address: samples(s) for s in replicas})
        assert any(took), "some replica accumulated this step"
        for s, a, n in zip(replicas, applied, took, strict=True):
            assert a is not None
            sent = float(a.residuals.sent.abs().sum()) > 0
            assert sent == (n > 0 or carried.get(s.address, False)), (n, carried, a)
            carried[s.address] = sent
        records.append(record)

    await _train(job, swarm, after_step)
    assert [r.step for r in records] == [0, 1, 2, 3]


async def _train(job: JobConfig, swarm: Swarm, after_step: Callable[[StepRecord], None]) -> None:
    """The job on `swarm`'s replicas, a trainer and a coordinator in this process, to its end."""
    coordinator = LocalCoordinator(job, fingerprint(job), swarm.members, on_step=after_step)
    try:
        await swarm.train(coordinator, seeded=False)
    finally:
        await coordinator.close()


@pytest.mark.parametrize("delayed", [False, True])
async def test_eager_rounds_carry_what_the_codec_dropped_into_the_next_rounds_sum(
    tmp_path: Path, make_swarm: list[Swarm], delayed: bool
) -> None:
    """pool.overlap = "eager" with int8 averaging: each round's background sum of the shares
    goes through the codec with error feedback (its residuals held once the sum arrived, keyed
    by the round's end), the job's last round too; the final mean is lossless, so every
    replica of a pool ends with the same parameters. `delayed`: delayed_update's eager rule,
    rounds of one step."""
    local = {"mode": "local", "sync_every": 2}
    job = make_job(
        tmp_path,
        training={"steps": 6, "target_batch_size": 16, "checkpoint_every": 0}
        | ({"delayed_update": True} if delayed else {}),
        compression={"averaging": "int8_blockwise", "block_size": 64},
        pool=({} if delayed else local) | {"overlap": "eager"},
        runtime={"data_plane": "relay"},
    )
    swarm = Swarm(job)
    make_swarm.append(swarm)
    await swarm.add_replicas(2)
    held: list[tuple[int, list[int | None]]] = []  # (step, each replica's residuals' step)

    def after_step(record: StepRecord) -> None:
        feedbacks = [s.servicer._feedback for stage in swarm.servers for s in stage]
        held.append(
            (record.step, [None if f._applied is None else f._applied.step for f in feedbacks])
        )

    await _train(job, swarm, after_step)
    assert [step for step, _ in held] == list(range(6))
    # The sum of round [0, 1] (ending at 2) has arrived by the end of round [2, 3]; the last
    # round's (ending at 6) was waited for.
    assert all(s is not None and s >= 2 for s in dict(held)[3]), held
    feedbacks = [s.servicer._feedback for stage in swarm.servers for s in stage]
    assert all(f._applied is not None and f._applied.step == 6 for f in feedbacks)
    assert any(float(f._applied.residuals.sent.abs().sum()) > 0 for f in feedbacks if f._applied)
    for stage in swarm.servers:  # the parameters: each replica's inner optimizer is its own
        first = stage[0].runtime.state_dict()
        for other in stage[1:]:
            for name, tensor in other.runtime.state_dict().items():
                assert torch.equal(tensor, first[name]), name
