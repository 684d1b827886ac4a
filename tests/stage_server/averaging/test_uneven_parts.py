"""Parts sized by the members' links (`RoundSettings.weights`), client-mode members (weight 0: own
nothing) and aggregators (members past `contributors`: own parts, contribute nothing), on real
gRPC replicas: every member ends with bitwise the sum in sender order, whatever the partition;
lossy codecs and their error feedback keep working; an owner that dies mid-round fails the round,
and the retry without it is exact."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from stage_server.averaging.butterfly import RoundSettings, all_reduce
from stage_server.averaging.error_feedback import Residuals
from stage_server.averaging.owner import Averager, AveragingAborted
from stage_server.averaging.service import PoolServicer
from swarm.errors import ConfigError, InvalidArgument
from swarm.policy.parts import Parts, part_bounds, water_fill
from swarm.wire.codec import CODEC_INT8_BLOCKWISE, decode, encode
from tests.support.pools import JOB, Replica, assert_identical, ordered_sum, reduce_all, replicas

pytestmark = pytest.mark.timeout(120)

R = (JOB, 0, "r")


async def test_an_owner_sums_the_contributors_only_in_sender_order() -> None:
    av = Averager()
    x = [torch.randn(5, dtype=torch.float64) for _ in range(2)]
    sums = await asyncio.gather(
        *(av.reduce(R, 2, s, 3, x[s], timeout_s=5, contributors=2) for s in (1, 0))
    )
    assert torch.equal(sums[0].tensor, x[0] + x[1]) and sums[0] is sums[1]
    with pytest.raises(InvalidArgument, match=r"sender 2 out of 0\.\.1"):
        await av.reduce((JOB, 0, "s"), 2, 2, 3, x[0], timeout_s=5, contributors=2)
    with pytest.raises(InvalidArgument, match="4 contributors in a group of 3"):
        await av.reduce((JOB, 0, "s"), 0, 0, 3, x[0], timeout_s=5, contributors=4)
    # One round, one count of contributors: a sender that says otherwise is refused.
    first = asyncio.ensure_future(av.reduce((JOB, 0, "t"), 0, 0, 3, x[0], timeout_s=5))
    await asyncio.sleep(0)
    with pytest.raises(InvalidArgument, match="others said 3 of 3"):
        await av.reduce((JOB, 0, "t"), 0, 1, 3, x[1], timeout_s=5, contributors=2)
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)


def _served(r: Replica, round: str) -> str | None:
    return r.averager.outcome((JOB, 0, round))


@pytest.mark.parametrize(
    "weights",
    [
        [0.1, 0.5, 0.15, 0.25],  # uneven
        [0.0, 1 / 3, 1 / 3, 1 / 3],  # the example: a client and three owners
        [0.0, 0.0, 0.0, 1.0],  # one owner of everything
        water_fill([10e6, 100e6, 100e6, 100e6]),
    ],
)
async def test_uneven_parts_and_clients_sum_to_the_same_bits(weights: list[float]) -> None:
    counted: list[tuple[int, int]] = []
    async with replicas(4) as pool:
        for numel in (1, 3, 100_003):
            flats = [torch.randn(numel, dtype=torch.float64) for _ in range(4)]
            rid = f"r{numel}"
            results = await reduce_all(
                pool,
                flats,
                round=rid,
                parts=Parts(weights),
                slice_bytes=8000,
                on_bytes=lambda s, r: counted.append((s, r)),
            )
            assert torch.equal(assert_identical(results), ordered_sum(flats))
            parts = part_bounds(numel, weights)
            for r, part in zip(pool, parts, strict=True):
                # An empty part is neither sent nor awaited: its owner never hears of the round.
                owns = part.stop > part.start
                assert _served(r, rid) == ("completed" if owns else None)
            assert all(r.averager.open_rounds() == set() for r in pool)
        # A client sends all of its vector and receives all of the sums; an owner less its part.
        parts = part_bounds(100_003, weights)
        expected = sorted(((100_003 - (p.stop - p.start)) * 8,) * 2 for p in parts)
        assert sorted(counted[-4:]) == expected


async def test_aggregators_own_parts_and_contribute_nothing() -> None:
    async with replicas(5) as pool:
        contributors, aggregators = pool[:3], pool[3:]
        group = [r.address for r in pool]
        weights = water_fill([100.0, 100.0, 50.0, 200.0, 150.0], 3)
        assert weights[3] > 0 and weights[4] > 0
        for numel in (2, 100_003):
            flats = [torch.randn(numel, dtype=torch.float64) for _ in contributors]
            rid = f"a{numel}"
            results = await reduce_all(
                contributors,
                flats,
                round=rid,
                group=group,
                parts=Parts(weights, 3),
                slice_bytes=8000,
            )
            assert torch.equal(assert_identical(results), ordered_sum(flats))
            for r, part in zip(pool, part_bounds(numel, weights), strict=True):
                assert _served(r, rid) == ("completed" if part.stop > part.start else None)
        assert all(_served(a, "a100003") == "completed" for a in aggregators)
        # An aggregator runs no all_reduce: asked to, it is refused before anything is sent.
        with pytest.raises(ConfigError, match="is an aggregator"):
            await all_reduce(
                torch.zeros(4),
                RoundSettings(
                    group=group,
                    index=3,
                    round="x",
                    job=JOB,
                    stage=0,
                    timeout_s=5,
                    chunk_bytes=1 << 20,
                    max_bytes=1 << 26,
                    parts=Parts((), 3),
                ),
                averager=aggregators[0].averager,
                channels=aggregators[0].channels,
            )


async def test_weights_a_round_cannot_cut_by_are_refused() -> None:
    async with replicas(2) as pool:
        for bad in ([1.0], [0.0, 0.0], [-1.0, 2.0], [float("nan"), 1.0]):
            results = await reduce_all(pool, [torch.ones(4)] * 2, round=f"{bad}", parts=Parts(bad))
            assert all(isinstance(r, InvalidArgument) for r in results), results


def _trip(x: torch.Tensor, block: int) -> torch.Tensor:
    return decode(encode(x, "t", CODEC_INT8_BLOCKWISE, block))


async def test_lossy_parts_are_encoded_per_uneven_part() -> None:
    weights, numel, block = [0.2, 0.0, 0.8], 30_001, 1000
    async with replicas(3) as pool:
        flats = [torch.randn(numel) for _ in range(3)]
        total = assert_identical(
            await reduce_all(
                pool, flats, codec=CODEC_INT8_BLOCKWISE, block_size=block, parts=Parts(weights)
            )
        )
    expected = torch.cat(
        [
            _trip(ordered_sum([_trip(f[p], block) for f in flats]), block)
            for p in part_bounds(numel, weights)
            if p.stop > p.start
        ]
    )
    assert torch.equal(total, expected)


async def test_error_feedback_with_uneven_parts_and_a_client_loses_nothing() -> None:
    n, numel, block, rounds = 3, 3000, 1000, 30
    weights = [0.0, 0.7, 0.3]  # member 0 a client: it owns no part, so no sum's residual
    torch.manual_seed(1)
    flats = []
    for _ in range(n):
        g = torch.rand(numel) * 2e-3 + 5e-4
        g[::block] = 1.0  # the rest under half an int8 step: lost without feedback
        flats.append(g)
    residuals = [Residuals(torch.zeros(numel), torch.zeros(numel)) for _ in range(n)]
    total = torch.zeros(numel, dtype=torch.float64)
    async with replicas(n) as pool:
        group = [r.address for r in pool]
        for k in range(rounds):
            calls = [
                all_reduce(
                    f,
                    RoundSettings(
                        group=group,
                        index=i,
                        round=f"e{k}",
                        job=JOB,
                        stage=0,
                        timeout_s=10,
                        chunk_bytes=1 << 20,
                        max_bytes=1 << 26,
                        codec=CODEC_INT8_BLOCKWISE,
                        block_size=block,
                        parts=Parts(weights),
                    ),
                    averager=r.averager,
                    channels=r.channels,
                    residuals=e,
                )
                for i, (r, f, e) in enumerate(zip(pool, flats, residuals, strict=True))
            ]
            total += assert_identical(await asyncio.gather(*calls)).double()
    exact = rounds * torch.stack(flats).double().sum(0)
    held = sum(r.sent.double() + r.summed.double() for r in residuals)
    assert torch.allclose(total + held, exact, rtol=1e-5, atol=1e-4)
    small = torch.ones(numel, dtype=torch.bool)
    small[::block] = False
    assert float(total[small].min()) > 0  # the small values arrived
    assert float(residuals[0].summed.abs().sum()) == 0  # the client owned nothing
    for r, part in zip(residuals, part_bounds(numel, weights), strict=True):
        outside = torch.ones(numel, dtype=torch.bool)
        outside[part] = False
        assert float(r.summed[outside].abs().sum()) == 0  # only over the part it owned
    assert all(float(r.summed.abs().sum()) > 0 for r in residuals[1:])


async def _kill_mid_round(
    pool: Sequence[Replica], victim: int, flats: Sequence[torch.Tensor], weights: list[float]
) -> list[Any]:
    """A round in which member `victim` dies once a contribution to its part reached it: its
    server stops (calls cut) and its own all_reduce is cancelled, as a SIGKILL would."""
    reached = asyncio.Event()
    reduce = pool[victim].averager.reduce

    async def reaching(*a: Any, **k: Any) -> Any:
        reached.set()
        return await reduce(*a, **k)

    pool[victim].averager.reduce = reaching  # type: ignore[method-assign]
    round = asyncio.ensure_future(
        reduce_all(pool, flats, round="k0", parts=Parts(weights), slice_bytes=8000, timeout_s=4)
    )
    await reached.wait()
    await pool[victim].server.stop(None)
    await pool[victim].channels.close()
    return await round


async def test_an_owner_dying_mid_round_fails_it_and_the_retry_without_it_is_exact() -> None:
    rates = [10.0, 100.0, 120.0, 80.0]
    weights = water_fill(rates)
    victim = 2  # the biggest part's owner
    async with replicas(4) as pool:
        flats = [torch.randn(200_003, dtype=torch.float64) for _ in range(4)]
        results = await _kill_mid_round(pool, victim, flats, weights)
        live = [i for i in range(4) if i != victim]
        for i in live:
            assert isinstance(results[i], AveragingAborted), results[i]
            assert victim in results[i].missing  # whom it failed on: the coordinator's culprit
        # The retry (a new round id) without it: new weights from the survivors' rates.
        survivors = [pool[i] for i in live]
        kept = [flats[i] for i in live]
        again = await reduce_all(
            survivors,
            kept,
            round="k1",
            parts=Parts(water_fill([rates[i] for i in live])),
            slice_bytes=8000,
        )
        assert torch.equal(assert_identical(again), ordered_sum(kept))


async def test_an_aggregator_holds_a_window_of_slices_per_contributor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An aggregator owning most of the vector still holds at most `window` slices of each
    contributor at once (each a Reduce call it serves), as any owner."""
    window, held, most = 2, [0], [0]
    watched: list[Averager] = []  # the aggregator's
    serve = PoolServicer._reduce

    async def counting(self: PoolServicer, requests: Any, context: Any) -> Any:
        mine = self.averager in watched
        held[0] += mine
        most[0] = max(most[0], held[0])
        try:
            return await serve(self, requests, context)
        finally:
            held[0] -= mine

    monkeypatch.setattr(PoolServicer, "_reduce", counting)
    async with replicas(4) as pool:
        watched.append(pool[3].averager)
        flats = [torch.randn(50_000, dtype=torch.float64) for _ in range(3)]
        results = await reduce_all(
            pool[:3],
            flats,
            group=[r.address for r in pool],
            parts=Parts([0.1, 0.05, 0.05, 0.8], 3),
            slice_bytes=8000,
            window=window,
        )
        assert torch.equal(assert_identical(results), ordered_sum(flats))
    assert 0 < most[0] <= window * 3  # its part: 40 slices of 1000 elements per contributor
