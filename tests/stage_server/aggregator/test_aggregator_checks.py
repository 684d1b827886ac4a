"""A hostile aggregator's finite wrong sum (issue 43, item 4): a pool of real stage servers (in
this process, so every replica can be inspected) and a real PoolService aggregator whose owner
side adds an error to every sum it answers (small and dense; under lossy codecs too, sparse, and
with a seed it knows: issue 54). Every replica takes the same wrong sum, so the
replicas stay identical and no check among them can see it: the coordinator's linear checksum
(`scheduler.coordinator.trust.sum_checks`) must. The round fails naming the aggregator, the retry
runs without it, and nothing wrong is ever applied: the job equals `swarm local`."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest
import torch

from scheduler.coordinator import LocalCoordinator, gather_state
from scheduler.coordinator import commit as commit_module
from scheduler.coordinator.groups import Aggregator, Groups, Link, RoundGroup
from scheduler.coordinator.trust import sum_checks
from scheduler.coordinator.trust.sum_checks import Mismatch, mismatches
from stage_server.averaging.checksum import PartChecks, weights
from stage_server.averaging.owner import Averager
from stage_server.averaging.service import PoolServicer
from stage_server.averaging.summing import Reduced
from swarm.errors import NotFound
from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.model.routes import Record
from swarm.proto import pool_pb2_grpc
from swarm.proto import stage_pb2 as pb
from tests.support.equality import assert_equal_to_reference
from tests.support.inprocess import Swarm
from tests.support.jobs import make_job

ERROR = 1e-3  # what the hostile aggregator adds to each element of every sum it answers


@contextlib.asynccontextmanager
async def _aggregator(job_id: str) -> AsyncIterator[tuple[str, Averager]]:
    """A PoolService that owns parts of `job_id`'s rounds and holds no model (an aggregator)."""

    def route(job: str, stage: int) -> None:
        if job != job_id:
            raise NotFound(f"job {job!r} is not served here")

    server, averager = grpc.aio.server(), Averager()
    servicer = PoolServicer(
        averager, route=route, chunk_bytes=1 << 20, max_bytes=1 << 28, timeout_s=30
    )
    pool_pb2_grpc.add_PoolServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", averager
    finally:
        await server.stop(None)


def _forging(aggregator: Averager, forge: Callable[[torch.Tensor], object]) -> list[int]:
    """`aggregator` sums with the first contribution changed by `forge` (before the sum, so a
    lossy codec encodes the wrong sum as an honest one); the lengths of the parts it forged."""
    honest, forged_sums = aggregator.summer, []

    def wrong(
        values: list[torch.Tensor], owned: list[bool], codec: int, block_size: int
    ) -> Reduced:
        forged = values[0].clone()
        forge(forged)
        forged_sums.append(forged.numel())
        return honest([forged, *values[1:]], [True, *owned[1:]], codec, block_size)

    aggregator.summer = wrong
    return forged_sums


async def _float32_pool(
    tmp_path: Path, make_swarm: list[Swarm], codec: str
) -> tuple[JobConfig, Swarm]:
    """A float32 job of 3 steps averaged with `codec`, and its pool of three replicas a stage."""
    job = make_job(
        tmp_path,
        training={"steps": 3, "target_batch_size": 32, "dtype": "float32"},
        compression={"averaging": codec, "block_size": 64},
    )
    swarm = Swarm(job)
    make_swarm.append(swarm)
    await swarm.add_replicas(3)
    return job, swarm


@pytest.mark.attack("43.4-sum")
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["step", "local", "eager"])
async def test_a_finite_wrong_sum_fails_the_round_naming_the_aggregator(
    tmp_path: Path, make_swarm: list[Swarm], caplog: pytest.LogCaptureFixture, mode: str
) -> None:
    """Three replicas a stage and one aggregator owning a part of every round (float64; with two
    contributors water-filling gives an aggregator nothing): its sums are off by 1e-3 an
    element. Every round it takes part in fails, naming it; it sits out the retry, which
    commits; the job equals `swarm local` within 1e-9 (`--routes` for local steps' rounds and
    eager rounds)."""
    pool = {} if mode == "step" else {"mode": "local", "sync_every": 2}
    pool |= {"overlap": "eager"} if mode == "eager" else {}
    job = make_job(
        tmp_path,
        training={"steps": 4, "target_batch_size": 32, "checkpoint_every": 0},
        pool=pool,
        runtime={"data_plane": "relay"},
    )
    swarm = Swarm(job)
    make_swarm.append(swarm)
    await swarm.add_replicas(3)
    async with _aggregator(fingerprint(job)) as (address, aggregator):
        # finite, small, the same for every member
        wrong_sums = _forging(aggregator, lambda forged: forged.add_(ERROR))
        offered = [Aggregator("agg", address, Link(100.0))]
        # Shunned for longer than the test: it must not come back for a later step.
        groups = Groups(lambda peer: Link(100.0), lambda stage: offered, shun_s=3600)
        routes: list[Record] = []
        coordinator = LocalCoordinator(
            job, fingerprint(job), swarm.members, groups=groups, on_route=routes.append
        )
        with caplog.at_level(logging.WARNING):
            await swarm.train(coordinator, trainers=2)
        assert wrong_sums, "the aggregator summed a part of a round"
        for stage in swarm.servers:  # the parameters (each inner optimizer is its own)
            first = stage[0].runtime.state_dict()
            for other in stage[1:]:
                for name, tensor in other.runtime.state_dict().items():
                    assert torch.equal(tensor, first[name]), name
        assert_equal_to_reference(job, await gather_state(coordinator), routes, tol=1e-9)
        assert coordinator.metrics.aborted_rounds._value.get() >= 1
        assert address not in groups.of(0, swarm.members()[0]).members  # it sits out
        assert all(len(stage) == 3 for stage in coordinator.replicas())  # no replica blamed
        named = [r.getMessage() for r in caplog.records if "checksum" in r.getMessage()]
        assert any(address in m for m in named), named
        await coordinator.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("codec", ["none", "fp16", "bf16", "int8_blockwise", "hadamard3"])
async def test_honest_float32_rounds_with_an_aggregator_pass_their_checksums(
    tmp_path: Path, make_swarm: list[Swarm], monkeypatch: pytest.MonkeyPatch, codec: str
) -> None:
    """The same pool in float32 (the owner's sums round) with an honest aggregator on a faster
    link than the replicas (uneven parts): every contributor reports a checksum of the
    aggregator's part (and of every replica's: issue 55) at every step, under a lossy averaging
    codec too (on the decoded values, the sum's encoding allowed for: issue 54), and no round
    fails."""
    job, swarm = await _float32_pool(tmp_path, make_swarm, codec)
    judged: list[dict[int, list[pb.SumCheck]]] = []

    def recorded(reports: dict[int, list[pb.SumCheck]], contributors: int) -> list[Mismatch]:
        judged.append({j: list(r) for j, r in reports.items()})
        return mismatches(reports, contributors)

    monkeypatch.setattr(sum_checks, "mismatches", recorded)
    async with _aggregator(fingerprint(job)) as (address, _):
        offered = [Aggregator("agg", address, Link(300.0))]
        groups = Groups(lambda peer: Link(100.0), lambda stage: offered)
        coordinator = LocalCoordinator(job, fingerprint(job), swarm.members, groups=groups)
        await swarm.train(coordinator, trainers=2)
        swarm.assert_replicas_identical()
        assert coordinator.metrics.aborted_rounds._value.get() == 0
        assert address in groups.of(0, swarm.members()[0]).members
        assert len(judged) >= 3 * len(swarm.servers)  # every stage of every step
        for reports in judged:
            assert sorted(reports) == [0, 1, 2]
            assert all(  # every part, the replicas' too (issue 55)
                [c.part for c in r] == [0, 1, 2, 3] and c.unit == 2.0**-24
                for r in reports.values()
                for c in r
            )
        await coordinator.close()


@pytest.mark.attack("H-checks")
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("codec", "forgery"),
    [("fp16", "dense"), ("int8_blockwise", "dense"), ("fp16", "sparse"), ("none", "sparse")],
)
async def test_a_forged_sum_is_caught_under_any_codec_and_each_stage_has_its_own_seed(
    tmp_path: Path,
    make_swarm: list[Swarm],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    codec: str,
    forgery: str,
) -> None:
    """Issue 54, H-checks. A lossy averaging codec asked no checksum: an aggregator adding 1e3
    to every element was applied by every replica. A sparse forgery (one element off by 1e3)
    must be caught as well. And one seed served every stage, so a replica of one stage knew the
    r that checks another's: each stage's PREPAREs now carry their own."""
    job, swarm = await _float32_pool(tmp_path, make_swarm, codec)
    seeds: dict[int, set[tuple[str, ...]]] = {}  # seed -> the groups it was sent to
    asked = commit_module.checked

    def recording(group: RoundGroup, seed: int) -> sum_checks.Checksums | None:
        seeds.setdefault(seed, set()).add(group.members)
        return asked(group, seed)

    monkeypatch.setattr(commit_module, "checked", recording)
    async with _aggregator(fingerprint(job)) as (address, aggregator):

        def forge(forged: torch.Tensor) -> None:
            if forgery == "dense":
                forged.add_(1e3)
            elif forged.numel():
                forged[forged.numel() // 2] += 1e3

        wrong_sums = _forging(aggregator, forge)
        offered = [Aggregator("agg", address, Link(100.0))]
        groups = Groups(lambda peer: Link(100.0), lambda stage: offered, shun_s=3600)
        coordinator = LocalCoordinator(job, fingerprint(job), swarm.members, groups=groups)
        with caplog.at_level(logging.WARNING):
            await swarm.train(coordinator, trainers=2)
        assert wrong_sums, "the aggregator summed a part of a round"
        assert coordinator.metrics.aborted_rounds._value.get() >= 1
        assert address not in groups.of(0, swarm.members()[0]).members  # it sits out
        named = [r.getMessage() for r in caplog.records if "checksum" in r.getMessage()]
        assert any(address in m for m in named), named
        swarm.assert_replicas_identical()
        for params in (s[0].runtime.state_dict() for s in swarm.servers):
            assert all(
                bool(torch.isfinite(t).all()) and t.abs().max() < 1e2 for t in params.values()
            )
        assert len(swarm.servers) >= 2 and seeds
        assert all(len(sent_to) == 1 for sent_to in seeds.values()), "a seed served two stages"
        await coordinator.close()


@pytest.mark.attack("H-checks")
def test_a_forger_who_knows_the_seed_passes_its_check_but_not_another_stages() -> None:
    """What a forger knowing r can do: answer S + e with r·e = 0, which that r cannot see (so no
    member learns its stage's seed but its own stage's replicas). Another stage's seed, which
    a replica elsewhere learns, is no help: its forgery fails the stage's own check. And since
    issue 55 the sum's norm is held to the contributions' too: an e past what their norms
    leave fails even with the seed known."""
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(1000, generator=gen, dtype=torch.float64) for _ in range(3)]
    total = xs[0] + xs[1] + xs[2]
    known, own = 12345, 67890
    r = weights(known, 0, 1000)
    e = torch.randn(1000, generator=gen, dtype=torch.float64) * 1e3
    e -= (r @ e) / (r @ r) * r  # invisible to the known seed's r
    forged = total + e

    def reports(seed: int) -> dict[int, list[pb.SumCheck]]:
        out = {}
        for j, x in enumerate(xs):
            checks = PartChecks(seed)
            checks.contributed(3, 0, x)
            checks.summed(3, 0, forged)
            out[j] = checks.report()
        return out

    # The seed it knows: r·S passes, but ‖S‖ = ‖total + e‖ is far past Σ ‖x_j‖.
    found = mismatches(reports(known), 3)
    assert [(m.contributor, m.what) for m in found] == [(j, "‖S‖") for j in range(3)]
    # The stage's own seed: every contributor sees it (in r·S already)
    assert [m.what for m in mismatches(reports(own), 3)] == ["r·S"] * 3
