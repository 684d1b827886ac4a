"""Pool averaging: the Averager alone, then real gRPC replicas (one server, Averager and
PoolServicer each, on 127.0.0.1 port 0) that must end bitwise identical, or all abort."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from typing import Any

import grpc
import pytest
import torch

from stage_server.averaging.butterfly import RoundSettings, all_reduce
from stage_server.averaging.flat import flatten, split_parts, unflatten
from stage_server.averaging.owner import MAX_GROUP_SIZE, Averager, AveragingAborted
from stage_server.averaging.service import PoolServicer
from swarm.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from swarm.proto import pool_pb2, tensor_pb2
from swarm.wire.codec import CODEC_FP16, CODEC_INT8_BLOCKWISE, decode, encode
from tests.support.pools import (
    JOB,
    MiB,
    Replica,
    assert_identical,
    ordered_sum,
    reduce_all,
    replicas,
)
from tests.support.waiting import wait_until

# --- pure helpers ----------------------------------------------------------------------------


@pytest.mark.parametrize(("numel", "n"), [(0, 1), (1, 5), (4, 5), (10, 3), (1000003, 4)])
def test_split_parts_are_contiguous_and_near_equal(numel: int, n: int) -> None:
    parts = split_parts(numel, n)
    assert len(parts) == n and parts[0].start == 0 and parts[-1].stop == numel
    assert all(a.stop == b.start for a, b in itertools.pairwise(parts))
    sizes = [p.stop - p.start for p in parts]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_flatten_unflatten_round_trip() -> None:
    like = [torch.randn(3, 4), torch.randn(5), torch.randn(())]
    flat = flatten(like)
    assert flat.shape == (18,) and flat.is_contiguous()
    back = unflatten(flat, like)
    assert all(torch.equal(a, b) for a, b in zip(like, back, strict=True))
    with pytest.raises(InvalidArgument):
        flatten([torch.zeros(2), torch.zeros(2, dtype=torch.float64)])
    with pytest.raises(InvalidArgument):
        unflatten(flat[:-1], like)


def test_flatten_of_tensors_laid_out_one_after_another_is_a_view_not_a_copy() -> None:
    # As `StageRuntime.prepare` gives a step's sums: views of one flat copy, in order.
    whole = torch.randn(18)
    like = [whole[:12].view(3, 4), whole[12:17], whole[17:].view(())]
    assert flatten(like).data_ptr() == whole.data_ptr() and torch.equal(flatten(like), whole)
    # Out of order, with a gap, or not contiguous: a copy, with the same values.
    for tensors in ([like[1], like[0]], [whole[:5], whole[6:]], [whole.view(3, 6).t()]):
        flat = flatten(tensors)
        assert flat.data_ptr() != whole.data_ptr()
        assert torch.equal(flat, torch.cat([t.reshape(-1) for t in tensors]))


# --- the Averager alone ----------------------------------------------------------------------

R = (JOB, 0, "r0")


async def test_sum_is_in_sender_order_whatever_the_arrival_order() -> None:
    av = Averager()
    values = [torch.randn(1001, dtype=torch.float32) * 10**i for i in range(4)]
    order = [2, 0, 3, 1]
    results = await asyncio.gather(
        *(av.contribute(R, 0, s, 4, values[s], timeout_s=5) for s in order)
    )
    expected = ordered_sum(values)
    assert all(torch.equal(r, expected) for r in results)
    assert results[0] is results[1]  # computed once, shared
    assert av.open_rounds() == set() and av.outcome(R) == "completed"


@pytest.mark.parametrize("n", [2, 3])
async def test_the_owners_own_first_contribution_is_summed_into_a_received_buffer(n: int) -> None:
    """Sender 0's values are the owner's own gradient (not to be written): the sum goes into
    sender 1's received buffer as c1 + c0, the same bits as c0 + c1, with no tensor more."""
    av = Averager()
    values = [torch.randn(1001, dtype=torch.float32) * 10**i for i in range(n)]
    own, received = values[0].clone(), [v.clone() for v in values[1:]]
    expected = ordered_sum(values)
    results = await asyncio.gather(
        av.reduce(R, 0, 0, n, own, timeout_s=5),
        *(av.reduce(R, 0, s, n, received[s - 1], timeout_s=5, owned=True) for s in range(1, n)),
    )
    assert all(torch.equal(r.tensor, expected) for r in results)
    assert results[0].tensor.data_ptr() == received[0].data_ptr()  # summed in place there
    assert torch.equal(own, values[0])  # the owner's gradient untouched


async def test_a_group_size_no_pool_has_is_refused_before_anything_is_allocated() -> None:
    # `PoolService.Reduce` carries the group size as a uint32: a hostile peer's 10^7 made the
    # owner allocate a slot per sender (6.4 s and +0.9 GiB on the event loop), 2^32 - 1 would
    # ask for 32 GiB per part. A round larger than any pool is refused at once.
    av = Averager()
    for size in (MAX_GROUP_SIZE + 1, 10**7, 2**32 - 1):
        with pytest.raises(InvalidArgument, match=f"group size {size} above {MAX_GROUP_SIZE}"):
            await asyncio.wait_for(av.contribute(R, 0, 0, size, torch.ones(4), timeout_s=30), 5)
    assert not av._open, "nothing of a refused round is kept"


async def test_bad_contributions_are_refused() -> None:
    av = Averager()
    x = torch.ones(4)
    with pytest.raises(InvalidArgument, match="out of"):
        await av.contribute(R, 0, 3, 3, x, timeout_s=1)
    first = asyncio.ensure_future(av.contribute(R, 0, 0, 3, x, timeout_s=5))
    await asyncio.sleep(0)
    with pytest.raises(InvalidArgument, match="group size"):
        await av.contribute(R, 0, 1, 2, x, timeout_s=1)
    with pytest.raises(InvalidArgument):
        await av.contribute(R, 0, 1, 3, torch.ones(5), timeout_s=1)
    with pytest.raises(InvalidArgument):
        await av.contribute(R, 0, 1, 3, torch.ones(4, dtype=torch.float64), timeout_s=1)
    with pytest.raises(InvalidArgument):
        await av.contribute(R, 0, 1, 3, x, timeout_s=1, codec=CODEC_FP16)
    with pytest.raises(InvalidArgument, match="other values"):
        await av.contribute(R, 0, 0, 3, x * 2, timeout_s=1)
    # A bit-identical retry joins and gets the same sum.
    retry = asyncio.ensure_future(av.contribute(R, 0, 0, 3, x.clone(), timeout_s=5))
    await asyncio.gather(*(av.contribute(R, 0, s, 3, x, timeout_s=5) for s in (1, 2)))
    assert torch.equal(await first, torch.full((4,), 3.0)) and torch.equal(await retry, await first)
    with pytest.raises(FailedPrecondition, match="completed already"):
        await av.contribute(R, 0, 1, 3, x, timeout_s=1)


async def test_timeout_aborts_every_waiter_and_forgets_the_round() -> None:
    av = Averager()
    start = time.monotonic()
    waiters = [
        asyncio.ensure_future(av.contribute(R, 1, s, 3, torch.ones(3), timeout_s=0.3))
        for s in (0, 2)
    ]
    for w in waiters:
        with pytest.raises(AveragingAborted, match=r"senders \[1\]"):
            await w
    assert time.monotonic() - start < 1.0
    assert av.open_rounds() == set() and (av.outcome(R) or "").startswith("aborted")
    with pytest.raises(AveragingAborted):  # a late contribution gets the reason at once
        await av.contribute(R, 1, 1, 3, torch.ones(3), timeout_s=5)


async def test_limits_and_history_are_bounded() -> None:
    av = Averager(max_open_rounds=2, history=3)
    pending = [
        asyncio.ensure_future(av.contribute((JOB, 0, f"r{i}"), 0, 0, 2, torch.ones(1), timeout_s=5))
        for i in range(2)
    ]
    await asyncio.sleep(0)
    with pytest.raises(ResourceExhausted):
        await av.contribute((JOB, 0, "r9"), 0, 0, 2, torch.ones(1), timeout_s=5)
    av.close()
    for p in pending:
        with pytest.raises(AveragingAborted, match="closed"):
            await p
    for i in range(5):
        await av.contribute((JOB, 1, f"s{i}"), 0, 0, 1, torch.ones(1), timeout_s=5)
    assert av.outcome((JOB, 1, "s4")) == "completed" and av.outcome((JOB, 1, "s1")) is None


# --- real replicas ---------------------------------------------------------------------------


def reference(flats: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack([f.double() for f in flats]).sum(0)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
async def test_all_replicas_end_bitwise_identical(n: int) -> None:
    async with replicas(n) as pool:
        for numel in sorted({1, max(n - 1, 0), 1000003}):
            flats = [torch.randn(numel, dtype=torch.float64) for _ in range(n)]
            results = await reduce_all(pool, flats, round=f"r{numel}")
            total = assert_identical(results)
            if n == 1:
                assert results[0] is flats[0]
            assert torch.equal(total, ordered_sum(flats))  # the owner's sender order, exactly
            assert torch.allclose(total, reference(flats), rtol=1e-12, atol=1e-12)
        assert all(r.averager.open_rounds() == set() for r in pool)


@pytest.mark.parametrize("n", [2, 3])
async def test_a_part_in_slices_sums_to_the_same_bits_and_the_owner_holds_a_window_of_them(
    n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A part travels in slices of `slice_bytes`, `window` at a time: the total is bitwise the
    whole part's (each element still summed once, in sender order), and an owner never holds
    more than `window` slices of each other sender at once."""
    numel, slice_bytes, window = 10_007, 1000 * 8, 2  # 1000 float64 a slice, uneven ends
    calls: dict[int, int] = {}  # owner -> Reduce calls it holds now
    most: dict[int, int] = {}  # owner -> the most it held at once
    serve = PoolServicer._reduce

    async def counting(self: PoolServicer, requests: Any, context: Any) -> Any:
        calls[id(self)] = calls.get(id(self), 0) + 1
        most[id(self)] = max(most.get(id(self), 0), calls[id(self)])
        try:
            return await serve(self, requests, context)
        finally:
            calls[id(self)] -= 1

    monkeypatch.setattr(PoolServicer, "_reduce", counting)
    async with replicas(n) as pool:
        flats = [torch.randn(numel, dtype=torch.float64) for _ in range(n)]
        sliced = assert_identical(
            await reduce_all(pool, flats, round="sliced", slice_bytes=slice_bytes, window=window)
        )
        whole = assert_identical(await reduce_all(pool, flats, round="whole", slice_bytes=1 << 30))
        assert torch.equal(sliced, whole) and torch.equal(sliced, ordered_sum(flats))
        assert all(r.averager.open_rounds() == set() for r in pool)
        for r in pool:
            assert r.averager.outcome((JOB, 0, "sliced")) == "completed"
    part = -(-numel // n)
    assert -(-part // 1000) > window  # more slices than the window: the bound was exercised
    assert 0 < max(most.values()) <= window * (n - 1)


async def test_a_round_whose_first_slices_are_summed_still_takes_its_later_ones() -> None:
    """Slices of a part complete one by one: a round with none open may have more to come (the
    owner's own later slices were refused as 'completed already' when it counted the round as
    done once nothing was open), while a late sender of a summed slice is refused."""
    av = Averager()
    x = torch.ones(4)
    await asyncio.gather(*(av.reduce(R, 0, s, 2, x, timeout_s=5, slice=0) for s in (0, 1)))
    assert av.open_rounds() == set()
    later = await asyncio.gather(
        *(av.reduce(R, 0, s, 2, x * 2, timeout_s=5, slice=1) for s in (0, 1))
    )
    assert torch.equal(later[0].tensor, x * 4) and later[0] is later[1]
    with pytest.raises(FailedPrecondition, match="slice 1: completed already"):
        await av.reduce(R, 0, 1, 2, x * 2, timeout_s=5, slice=1)
    assert av.outcome(R) == "completed"


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
async def test_float32_and_bfloat16(dtype: torch.dtype, tol: float) -> None:
    async with replicas(3) as pool:
        flats = [torch.randn(100003).to(dtype) for _ in range(3)]
        total = assert_identical(await reduce_all(pool, flats))
        assert total.dtype == dtype and torch.equal(total, ordered_sum(flats))
        assert torch.allclose(total.double(), reference(flats), rtol=tol, atol=tol)


def _trip(x: torch.Tensor, codec: int, block: int) -> torch.Tensor:
    return decode(encode(x, "t", codec, block))


@pytest.mark.parametrize("codec", [CODEC_FP16, CODEC_INT8_BLOCKWISE])
async def test_compressed_parts_stay_identical(codec: int) -> None:
    n, numel, block = 4, 50001, 1000
    async with replicas(n) as pool:
        flats = [torch.randn(numel) for _ in range(n)]
        total = assert_identical(
            await reduce_all(pool, flats, codec=codec, block_size=block, chunk_bytes=16 * 1024)
        )
        # Exactly the documented rule: every contribution and each part's sum make one round trip.
        expected = torch.cat(
            [
                _trip(ordered_sum([_trip(f[p], codec, block) for f in flats]), codec, block)
                for p in split_parts(numel, n)
            ]
        )
        assert torch.equal(total, expected)
        ref, big = reference(flats), max(float(f.abs().max()) for f in flats)
        # Per value: n contributions and the sum rounded; fp16 keeps 11 bits, int8 half a step.
        step = 2.0**-11 if codec == CODEC_FP16 else 1 / 254
        bound = (n * big + float(ref.abs().max())) * step * 1.01
        assert float((total.double() - ref).abs().max()) <= bound


async def test_large_tensors_travel_in_chunks() -> None:
    n, numel = 4, 2 * MiB  # 8 MiB of float32 per replica
    counted: list[tuple[int, int]] = []
    async with replicas(n) as pool:
        flats = [torch.randn(numel) for _ in range(n)]
        start = time.perf_counter()
        results = await reduce_all(
            pool, flats, chunk_bytes=64 * 1024, on_bytes=lambda s, r: counted.append((s, r))
        )
        elapsed = time.perf_counter() - start
        assert torch.equal(assert_identical(results), ordered_sum(flats))
    part_bytes = numel // n * 4
    assert counted == [(3 * part_bytes, 3 * part_bytes)] * n
    print(f"all-reduce of 8 MiB float32 over {n} local replicas: {elapsed * 1000:.0f} ms")


async def _assert_all_abort(results: Sequence[Any], pool: Sequence[Replica], limit: float) -> None:
    assert all(isinstance(r, AveragingAborted) for r in results), results
    await wait_until(  # the round is forgotten everywhere
        lambda: not any(r.averager.open_rounds() for r in pool),
        lambda: f"no open rounds: {[r.averager.open_rounds() for r in pool]}",
        timeout_s=limit,
    )


async def test_a_closed_port_aborts_every_live_replica() -> None:
    async with replicas(4) as pool:
        dead, live = pool[1], [pool[0], *pool[2:]]
        await dead.server.stop(None)
        group = [r.address for r in pool]
        flats = [torch.randn(1000) for _ in live]
        start = time.monotonic()
        calls = [
            all_reduce(
                f,
                RoundSettings(
                    group=group,
                    index=group.index(r.address),
                    round="r0",
                    job=JOB,
                    stage=0,
                    timeout_s=2.0,
                    chunk_bytes=MiB,
                    max_bytes=64 * MiB,
                ),
                averager=r.averager,
                channels=r.channels,
            )
            for r, f in zip(live, flats, strict=True)
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert time.monotonic() - start < 2.5
        assert any(dead.address in str(r) for r in results)
        await _assert_all_abort(results, live, 1.0)


async def test_a_silent_replica_aborts_every_live_replica_within_the_timeout() -> None:
    timeout = 1.0  # the job's: every member's call and every owner's round
    async with replicas(4, timeout_s=timeout) as pool:
        silent = 2
        group = [r.address for r in pool]
        start = time.monotonic()
        calls = [
            all_reduce(
                torch.randn(777),
                RoundSettings(
                    group=group,
                    index=i,
                    round="r0",
                    job=JOB,
                    stage=0,
                    timeout_s=timeout,
                    chunk_bytes=MiB,
                    max_bytes=64 * MiB,
                ),
                averager=r.averager,
                channels=r.channels,
            )
            for i, r in enumerate(pool)
            if i != silent
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert time.monotonic() - start < timeout + 0.5
        assert any(pool[silent].address in str(r) for r in results)
        await _assert_all_abort(results, pool, timeout + 0.5)  # the silent one's too


async def test_concurrent_rounds_of_stages_and_ids_do_not_mix() -> None:
    async with replicas(3) as pool:
        cases = [(0, "r"), (1, "r"), (0, "r2")]
        data = {c: [torch.randn(5003, dtype=torch.float64) for _ in pool] for c in cases}
        outs = await asyncio.gather(
            *(reduce_all(pool, data[c], stage=c[0], round=c[1]) for c in cases)
        )
        for c, results in zip(cases, outs, strict=True):
            assert torch.equal(assert_identical(results), ordered_sum(data[c]))


async def test_route_refusal_surfaces_as_aborted() -> None:
    async with replicas(2) as pool:
        results = await reduce_all(pool, [torch.ones(10)] * 2, job="other-job", timeout_s=5.0)
        assert all(isinstance(r, AveragingAborted) for r in results), results
        assert all("NOT_FOUND" in str(r) or "aborted" in str(r) for r in results)
        assert any("NOT_FOUND" in str(r) for r in results)
        assert all(r.averager.open_rounds() == set() for r in pool)


@pytest.mark.parametrize(
    ("tensor", "code"),
    [
        (encode(torch.ones(3), "x"), grpc.StatusCode.INVALID_ARGUMENT),
        (
            tensor_pb2.Tensor(name="part", dtype="float32", shape=[1 << 30], nbytes=4 << 30),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ),
    ],
)
async def test_servicer_maps_bad_requests_to_status_codes(
    tensor: tensor_pb2.Tensor, code: grpc.StatusCode
) -> None:
    async with replicas(1) as (r,):
        request = pool_pb2.PoolReduceRequest(
            job=JOB, round="r0", part=0, sender=0, group_size=1, tensors=[tensor]
        )
        call: Any = r.channels.stub(r.address).Reduce(timeout=5)
        await call.write(request)
        await call.done_writing()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
        assert info.value.code() == code
