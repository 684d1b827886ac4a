"""Strangers' `Reduce` calls against a live stage server's pool service (issue 44): headers that
declare a GiB part and send nothing hold none of the receive budget (N6), and contributions
whose callers hung up leave no round state behind, and a round holds a bounded number of
slices (N13)."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
from typing import Any

import grpc
import pytest
import torch

from stage_server.server import RunningStageServer, StageServerOptions, start_stage_server
from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.proto import pool_pb2, pool_pb2_grpc, tensor_pb2
from swarm.proto.framing import frame
from swarm.wire import chunking as wire
from swarm.wire.chunking import TENSOR_OVERHEAD_BYTES
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
GiB = 1 << 30


# `job` and `server` (conftest): `[runtime]` defaults (1 GiB tensors), the peer's default limits
# (a 4 GiB receive budget).


def _header(job: str, nbytes: int, *, round: str, group_size: int = 2, **kw: Any) -> Any:
    """A Reduce's first message declaring a float32 part of `nbytes` bytes, sent as chunks."""
    part = tensor_pb2.Tensor(name="part", dtype="float32", shape=[nbytes // 4], nbytes=nbytes)
    return pool_pb2.PoolReduceRequest(
        job=job,
        stage=1,
        round=round,
        part=0,
        sender=0,
        group_size=group_size,
        tensors=[part],
        **kw,
    )


async def _honest_reduce(channel: grpc.aio.Channel, job: str, values: torch.Tensor) -> Any:
    """A contribution of `values` to a round of one replica (its own sum comes back)."""
    header = pool_pb2.PoolReduceRequest(
        job=job, stage=1, round="honest", part=0, sender=0, group_size=1
    )
    call = pool_pb2_grpc.PoolServiceStub(channel).Reduce(timeout=30)
    for m in wire.split_tensor(header, "part", values, 64 << 10):
        await call.write(m)
    await call.done_writing()
    reply: wire.Received[Any] = await wire.receive_reply(call, max_bytes=GiB)
    return wire.decode_named(reply)["sum"]


@pytest.mark.attack("N6")
async def test_reduce_headers_declaring_a_gib_and_sending_nothing_hold_no_budget(
    server: RunningStageServer, job: JobConfig
) -> None:
    # Four callers declare a 1 GiB part each (the budget's 4 GiB in all) and send no byte of
    # it. Before the fix they held the whole budget until the averaging timeout (60 s) and an
    # honest Reduce was refused (RESOURCE_EXHAUSTED, "--receive-budget-bytes").
    budget = server.servicer.budget
    declared = GiB - TENSOR_OVERHEAD_BYTES  # charged a GiB with its tensor's overhead
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = pool_pb2_grpc.PoolServiceStub(channel)
        fakes = [stub.Reduce(timeout=60) for _ in range(4)]
        try:
            for i, fake in enumerate(fakes):
                await fake.write(_header(fingerprint(job), declared, round=f"fake{i}"))
            # Each header is read (it holds its own few bytes); nothing more is held for the
            # bytes it declared and never sent.
            await wait_until(
                lambda: budget.in_use >= 4 * TENSOR_OVERHEAD_BYTES, "headers read", timeout_s=20
            )
            assert not any(f.done() for f in fakes)
            assert budget.in_use < MiB, f"{budget.in_use} bytes held for bodies never sent"
            values = torch.arange(1 << 18, dtype=torch.float32)  # a 1 MiB part, 16 chunks
            got = await _honest_reduce(channel, fingerprint(job), values)
            assert torch.equal(got, values)
        finally:
            for fake in fakes:
                fake.cancel()
    await wait_until(lambda: budget.in_use == 0, "the budget given back", timeout_s=20)


@pytest.mark.attack("N6")
async def test_a_part_holds_the_bytes_it_sent_and_past_the_budget_is_refused(
    job: JobConfig,
) -> None:
    # What a part holds follows its bytes as they come, never past its declaration; a part
    # declared past what is free now is still refused at once, as are bytes past the budget.
    from stage_server.peer.limits import PeerLimits

    limits = PeerLimits(max_tensor_bytes=4 * MiB, receive_budget_bytes=4 * MiB)
    running = await start_stage_server(job, StageServerOptions(stage=1, limits=limits))
    budget = running.servicer.budget
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            stub = pool_pb2_grpc.PoolServiceStub(channel)
            sending = stub.Reduce(timeout=60)
            await sending.write(_header(fingerprint(job), 3 * MiB, round="a"))
            await wait_until(lambda: budget.in_use > 0, "the header read", timeout_s=20)
            head = budget.in_use
            assert head < 2 * TENSOR_OVERHEAD_BYTES, head  # its fields, not its 3 MiB
            cls = pool_pb2.PoolReduceRequest
            await sending.write(frame(cls, 0, bytes(2 * MiB)))
            await wait_until(
                lambda: budget.in_use == head + 2 * MiB, "2 MiB held as they came", timeout_s=20
            )
            # 2 MiB free: a part declaring 3 MiB more is refused from its header.
            other = stub.Reduce(timeout=60)
            await other.write(_header(fingerprint(job), 3 * MiB, round="b"))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await other.read()
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--receive-budget-bytes" in (info.value.details() or "")
            # One declaring 1.5 MiB fits, and holds its bytes as they come; then the first's
            # last MiB is past the budget: that call is refused, its bytes given back.
            third = stub.Reduce(timeout=60)
            await third.write(_header(fingerprint(job), 3 * MiB // 2, round="c"))
            await third.write(frame(cls, 0, bytes(5 * MiB // 4)))
            await wait_until(
                lambda: budget.in_use > head + 3 * MiB + MiB // 4, "c's bytes", timeout_s=20
            )
            await sending.write(frame(cls, 0, bytes(MiB)))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await sending.read()
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            await wait_until(
                lambda: budget.in_use < 2 * MiB, "the refused call's bytes back", timeout_s=20
            )
            third.cancel()
        await wait_until(lambda: budget.in_use == 0, "the budget given back", timeout_s=20)
    finally:
        await running.stop()


async def _hung_up_contributions(server: RunningStageServer, job: JobConfig, n: int) -> None:
    """`n` callers each contribute an empty part to a round of 1,024 (its other senders never
    come), then hang up before the sum."""
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = pool_pb2_grpc.PoolServiceStub(channel)
        calls = []
        for i in range(n):
            call = stub.Reduce(timeout=60)
            await call.write(_header(fingerprint(job), 0, round="empty", group_size=1024, slice=i))
            await call.done_writing()
            calls.append(call)
        averager = server.servicer.averager
        await wait_until(
            lambda: len(averager._open.get(_key(job), {})) == n, "every part admitted", timeout_s=20
        )
        for call in calls:
            call.cancel()
        # The server sees each hang-up as the call's cancellation.
        await asyncio.sleep(0.5)


def _key(job: JobConfig) -> tuple[str, int, str]:
    return (fingerprint(job), 1, "empty")


@pytest.mark.attack("N13")
async def test_contributions_whose_callers_hung_up_leave_no_round_state(
    server: RunningStageServer, job: JobConfig
) -> None:
    # Before the fix each hung-up empty contribution kept its slot (a sender list of 1,024 and
    # a timer, about 20 KiB) until the averaging timeout (60 s), however many came: 500 slots
    # open and ~19.7 KiB a call still allocated after every caller was gone.
    averager = server.servicer.averager
    await _hung_up_contributions(server, job, 20)  # warm-up: gRPC's own first allocations
    await wait_until(
        lambda: not averager.open_rounds(), "the warm-up's state dropped", timeout_s=20
    )
    n = 200  # (within the 256 calls one connection may hold open at once)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        await _hung_up_contributions(server, job, n)
        await wait_until(
            lambda: not averager.open_rounds(), "every hung-up part's state dropped", timeout_s=20
        )
        gc.collect()
        kept = (tracemalloc.get_traced_memory()[0] - before) / n
    finally:
        tracemalloc.stop()
    assert kept < 6144, f"{kept:.0f} bytes a hung-up call still allocated"
    assert server.servicer.budget.in_use == 0


async def test_a_part_someone_still_waits_for_keeps_a_hung_up_senders_contribution() -> None:
    # Only a part no one waits for is dropped: while the owner waits for its own part's sum, a
    # sender that hung up stays counted (its retry of the same bits joins), and the sum comes.
    from stage_server.averaging.owner import Averager

    averager, key = Averager(), ("job", 0, "r")
    a, b, c = (torch.full((4,), float(v)) for v in (1, 2, 4))
    own = asyncio.ensure_future(averager.reduce(key, 0, 0, 3, a, timeout_s=30))
    hung = asyncio.ensure_future(averager.reduce(key, 0, 1, 3, b, timeout_s=30))
    await asyncio.sleep(0)
    hung.cancel()
    await asyncio.gather(hung, return_exceptions=True)
    assert averager.open_rounds() == {key}
    third = await averager.reduce(key, 0, 2, 3, c, timeout_s=30)
    assert torch.equal(third.tensor, torch.full((4,), 7.0))
    assert torch.equal((await own).tensor, third.tensor)
    # One whose every contributor hung up goes at once, not at its timeout.
    gone = asyncio.ensure_future(averager.reduce(("job", 0, "s"), 0, 1, 3, b, timeout_s=30))
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    assert averager.open_rounds() == set()


async def _slice_of_one(stub: Any, job: str, round: str, slice: int) -> grpc.StatusCode:
    """A round of one's empty contribution to `slice`: summed at once (OK), or refused."""
    call = stub.Reduce(timeout=30)
    try:
        await call.write(_header(job, 0, round=round, group_size=1, slice=slice))
        await call.done_writing()
        await wire.receive_reply(call, max_bytes=MiB)
    except grpc.aio.AioRpcError as e:
        assert "slices of the round are open or summed" in str(e.details()), e.details()
        return e.code()
    return grpc.StatusCode.OK


@pytest.mark.attack("N13")
async def test_a_strangers_new_slices_are_summed_up_to_the_bound_then_refused(
    server: RunningStageServer, job: JobConfig
) -> None:
    # A stranger's Reduce calls through the pool service, each a round of one on a new slice:
    # each completes at once and is remembered with its round (a late sender is told it came
    # too late). Before the fix without bound; now the round holds `max_open_slices` (4,096),
    # the next is refused, and another round is still served.
    bound, fp = server.servicer.averager._max_open_slices, fingerprint(job)
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = pool_pb2_grpc.PoolServiceStub(channel)
        for first in range(0, bound, 128):  # 128 calls at once (one connection holds 256)
            codes = await asyncio.gather(
                *(_slice_of_one(stub, fp, "r", s) for s in range(first, first + 128))
            )
            assert set(codes) == {grpc.StatusCode.OK}, codes
        assert await _slice_of_one(stub, fp, "r", bound) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await _slice_of_one(stub, fp, "other", 0) == grpc.StatusCode.OK


async def test_a_round_keeps_at_most_max_open_slices_summed_or_open() -> None:
    # Each summed slice is remembered for its round (a late sender is told it came too late):
    # before the fix without bound, ~190 bytes kept a completed call (a round of one, a new
    # slice each time), for as long as the round is in the history.
    from stage_server.averaging.owner import Averager
    from swarm.errors import ResourceExhausted

    averager, key, empty = Averager(max_open_slices=4), ("job", 0, "r"), torch.zeros(0)
    for s in range(4):
        await averager.reduce(key, 0, 0, 1, empty, timeout_s=30, slice=s)
    with pytest.raises(ResourceExhausted, match="4 slices of the round"):
        await averager.reduce(key, 0, 0, 1, empty, timeout_s=30, slice=4)
    await averager.reduce(("job", 0, "other"), 0, 0, 1, empty, timeout_s=30)  # another round


async def _open_contributions(
    averager: Any, n: int, round: str, group_size: int = 1024
) -> list[asyncio.Task[Any]]:
    """`n` empty contributions to slices of a round of `group_size` whose other senders never
    come, each still waited for (its caller holds on)."""
    key, empty = ("job", 0, round), torch.zeros(0)
    tasks = [
        asyncio.ensure_future(averager.reduce(key, 0, 0, group_size, empty, timeout_s=60, slice=s))
        for s in range(n)
    ]
    await wait_until(lambda: len(averager._open.get(key, {})) == n, "all open", timeout_s=20)
    return tasks


async def _held_per_open_contribution(group_size: int) -> float:
    from stage_server.averaging.owner import Averager

    averager = Averager(max_open_slices=10_000)
    await _open_contributions(averager, 20, "warm-up")  # the loop's own first allocations
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tasks = await _open_contributions(averager, 500, "open", group_size)
        gc.collect()
        return (tracemalloc.get_traced_memory()[0] - before) / 500
    finally:
        tracemalloc.stop()
        averager.close()
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.attack("N13")
async def test_an_open_contribution_costs_what_came_not_the_group_it_names() -> None:
    # Issue 54 (N13 still open): 32,768 empty contributions held open took the averager from
    # 279 to 982 MiB: each slot kept two lists as long as the group it named (1,024 senders),
    # ~17 KiB, while its caller waited (20 KiB a contribution, its call's own task included).
    # Now a slot holds what came: naming a group of 1,024 costs what naming one of 2 does.
    small, large = await _held_per_open_contribution(2), await _held_per_open_contribution(1024)
    assert large - small < 1024, f"{small:.0f} bytes for a group of 2, {large:.0f} for 1,024"
    assert large < 6144, f"{large:.0f} bytes an open empty contribution holds"


@pytest.mark.attack("N13")
async def test_open_slices_of_every_round_together_are_bounded() -> None:
    # Each round held up to 4,096 slices and 64 rounds could be open: 262,144 open slots. Now
    # `max_open_total` bounds the open ones of all rounds together; the next is refused, and one
    # completes once another closes.
    from stage_server.averaging.owner import Averager
    from swarm.errors import ResourceExhausted

    averager = Averager(max_open_total=30)
    tasks = await _open_contributions(averager, 20, "a")
    tasks += await _open_contributions(averager, 10, "b")
    with pytest.raises(ResourceExhausted, match="30 parts of rounds are open"):
        await averager.reduce(("job", 0, "c"), 0, 0, 2, torch.zeros(0), timeout_s=30)
    averager.abort(("job", 0, "a"), "gone")
    await averager.reduce(("job", 0, "c"), 0, 0, 1, torch.zeros(0), timeout_s=30)
    averager.close()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_reduce_holds_its_budget_until_its_sum_is_sent(
    server: RunningStageServer, job: JobConfig
) -> None:
    """The receive budget was given back once the sum was made, before it was sent: a caller
    that never reads its reply (its sum, and under a lossy codec its encoding beside) kept that
    memory outside every bound, for as long as it kept the stream. Now the call's part stays
    charged until its reply is sent."""
    budget, part = server.servicer.budget, 64 * MiB
    header = pool_pb2.PoolReduceRequest(
        job=fingerprint(job), stage=1, round="solo", part=0, sender=0, group_size=1
    )
    options = wire.grpc_options(job.runtime.max_message_bytes)  # a sum's chunks, as a peer's
    async with grpc.aio.insecure_channel(server.address, options=options) as channel:
        call = pool_pb2_grpc.PoolServiceStub(channel).Reduce(timeout=60)
        for m in wire.split_tensor(header, "part", torch.ones(part // 4), 1 * MiB):
            await call.write(m)
        await call.done_writing()
        first = await call.read()  # the sum is made and on its way: the rest unread
        assert first is not grpc.aio.EOF
        assert budget.in_use >= part, f"{budget.in_use} bytes charged while the sum is sent"
        while await call.read() is not grpc.aio.EOF:
            pass
    await wait_until(lambda: budget.in_use == 0, "the budget given back", timeout_s=10)
