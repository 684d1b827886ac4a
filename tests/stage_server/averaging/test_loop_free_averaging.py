"""An averaging round never makes the event loop wait on the device (issue 41, item 3): a
gradient on a slow device (`tests.support.fake_device.GatedCopies`, behind the staging's
`ChunkCopies` seam) is copied to the host and its sums back off the loop, so the loop goes on
(other rounds' bytes, other calls) while a copy is under way; over real gRPC replicas.

The slow copy holds its thread until the test opens the gate, which the test does from the
event loop once it has seen the copy begin: a copy on the loop can never see the gate open (it
times out), whatever the machine's speed. On CUDA (skipped without it) torch's own copies run on
the round's thread, with the gradient's device its current one, and give the CPU's bits."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch

from stage_server.averaging.butterfly import RoundSettings, all_reduce
from swarm.wire.codec import CODEC_FP16, CODEC_NONE
from tests.support.fake_device import CountingCopies, GatedCopies, WatchedCopies, copy_started
from tests.support.pools import JOB, MiB, ordered_sum, reduce_all, replicas

pytestmark = pytest.mark.timeout(120)

CHUNK = 2048
SLICE = 8192


@pytest.mark.parametrize(
    ("slow", "codec"),
    [("to_host", CODEC_NONE), ("to_device", CODEC_NONE), ("to_host", CODEC_FP16)],
)
async def test_the_loop_runs_while_a_round_copies_a_device_gradient(slow: str, codec: int) -> None:
    gen = torch.Generator().manual_seed(13)
    flats = [torch.randn(6000, generator=gen) for _ in range(2)]
    given = [f.clone() for f in flats]
    gated = GatedCopies(slow, seconds=5.0)
    copies: list[Any] = [gated, CountingCopies()]
    async with replicas(2) as pool:
        rounds = asyncio.ensure_future(
            reduce_all(
                pool,
                given,
                copies=copies,
                timeout_s=30.0,
                chunk_bytes=CHUNK,
                slice_bytes=SLICE,
                in_place=True,
                codec=codec,
            )
        )
        await asyncio.wait_for(copy_started(gated), 30)
        await asyncio.sleep(0.01)  # the loop wakes (a timer) while the copy is under way
        woke_during_copy = gated.opened is None
        gated.gate.set()
        results = await rounds
    assert woke_during_copy, "the loop woke only after the device's copy had ended"
    assert gated.opened is True, "the copy blocked the event loop until it timed out"
    assert threading.main_thread().name not in gated.threads  # the loop's thread never copied
    want = ordered_sum(flats) if codec == CODEC_NONE else None
    for result, flat in zip(results, given, strict=True):
        assert isinstance(result, torch.Tensor), repr(result)
        assert result.data_ptr() == flat.data_ptr()
        if want is not None:
            assert torch.equal(result, want)  # bitwise, as on the CPU
    first, second = results
    assert isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor)
    assert torch.equal(first, second)  # the replicas agree, bit for bit


async def test_a_round_cancelled_mid_copy_ends_only_once_the_copy_has_landed() -> None:
    """A failed or cancelled round's caller restores the gradient (`spill`): no sum may still
    be landing in it after the round has ended, so the round waits for its copy under way."""
    flats = [torch.randn(6000, generator=torch.Generator().manual_seed(k)) for k in range(2)]
    gated = GatedCopies("to_device", seconds=5.0)
    copies: list[Any] = [gated, CountingCopies()]
    landed_when_done: list[bool] = []
    async with replicas(2) as pool:
        group = [r.address for r in pool]
        opts: dict[str, Any] = {
            "round": "r0",
            "job": JOB,
            "stage": 0,
            "timeout_s": 30.0,
            "chunk_bytes": CHUNK,
            "max_bytes": 64 * MiB,
            "slice_bytes": SLICE,
            "in_place": True,
        }
        tasks = [
            asyncio.ensure_future(
                all_reduce(
                    f,
                    RoundSettings(group=group, index=i, **opts),
                    averager=r.averager,
                    channels=r.channels,
                    copies=c,
                )
            )
            for i, (r, f, c) in enumerate(zip(pool, flats, copies, strict=True))
        ]
        tasks[0].add_done_callback(lambda _: landed_when_done.append(gated.ended.is_set()))
        await asyncio.wait_for(copy_started(gated), 30)
        tasks[0].cancel()
        await asyncio.sleep(0.05)  # the cancellation goes through (the copy still held)
        gated.gate.set()
        results = await asyncio.gather(tasks[0], return_exceptions=True)
        tasks[1].cancel()  # its partner left: it would wait out timeout_s (not under test here)
        await asyncio.gather(tasks[1], return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError), repr(results[0])
    assert landed_when_done == [True], "the round ended while its copy was still landing"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_on_cuda_a_rounds_copies_run_off_the_loop_on_the_gradients_device() -> None:
    index = torch.cuda.device_count() - 1  # the last GPU: a thread starts on cuda:0
    gen = torch.Generator().manual_seed(17)
    cpu = [torch.randn(1 << 20, generator=gen) for _ in range(2)]
    on_gpu = [t.to(f"cuda:{index}") for t in cpu]
    watched = [WatchedCopies(), WatchedCopies()]
    async with replicas(2) as pool:
        group = [r.address for r in pool]
        opts: dict[str, Any] = {
            "round": "r0",
            "job": JOB,
            "stage": 0,
            "timeout_s": 60.0,
            "chunk_bytes": 256 << 10,
            "max_bytes": 64 * MiB,
            "slice_bytes": 1 * MiB,
            "in_place": True,
        }
        calls = [
            all_reduce(
                f,
                RoundSettings(group=group, index=i, **opts),
                averager=r.averager,
                channels=r.channels,
                copies=c,
            )
            for i, (r, f, c) in enumerate(zip(pool, on_gpu, watched, strict=True))
        ]
        results = await asyncio.gather(*calls)
    want = ordered_sum(cpu)
    for result, flat, w in zip(results, on_gpu, watched, strict=True):
        assert result.data_ptr() == flat.data_ptr()
        assert torch.equal(result.cpu(), want)  # bitwise the CPU's sum
        assert w.threads and threading.main_thread().name not in w.threads
        assert w.devices == {index}
