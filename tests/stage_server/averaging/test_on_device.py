"""A gradient on a device (cuda) averaged in place, as on the CPU, staged through host memory a
chunk at a time (issue 41, deliverable 5), over real gRPC replicas on 127.0.0.1.

On the CPU a counting fake device (`ChunkCopies`) treats the replicas' CPU gradients as a
device's and measures every byte that crosses: each element goes to the host once and its sum
comes back once, no copy larger than a chunk, and the sum lands in the gradient itself. Before,
a device's round built a host tensor of the whole gradient for the total and then a device copy
of it (`total.to(device)`), and its own part went to the host whole. On CUDA (skipped without
it) the same round allocates no gradient-sized device memory and is bitwise the CPU's sum."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from stage_server.averaging.spill import Spill
from swarm.wire.codec import CODEC_FP16, CODEC_INT8_BLOCKWISE
from tests.support.fake_device import CountingCopies
from tests.support.pools import MiB, Replica, ordered_sum, reduce_all, replicas

pytestmark = pytest.mark.timeout(120)

CHUNK = 2048  # bytes a message's chunk (and a staged copy) takes at most
SLICE = 8192  # bytes a part's slice takes


async def _round(
    pool: list[Replica], flats: list[torch.Tensor], copies: list[Any], **settings: Any
) -> list[Any]:
    opts: dict[str, Any] = {"chunk_bytes": CHUNK, "slice_bytes": SLICE, "in_place": True}
    return await reduce_all(pool, flats, copies=copies, **(opts | settings))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
async def test_a_device_gradient_is_summed_in_place_through_chunks(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    flats = [torch.randn(10_001, generator=gen, dtype=dtype) for _ in range(3)]
    want = ordered_sum(flats)
    copies = [CountingCopies() for _ in flats]
    given = [f.clone() for f in flats]
    async with replicas(3) as pool:
        results = await _round(pool, given, copies)
    nbytes = flats[0].nbytes
    for result, flat, counted in zip(results, given, copies, strict=True):
        assert isinstance(result, torch.Tensor), repr(result)
        assert torch.equal(result, want)  # bitwise the CPU's sum in sender order
        assert result.data_ptr() == flat.data_ptr()  # in the gradient itself: no second one
        # Each element crossed once each way, a chunk at a time: no copy of the gradient.
        assert counted.to_host_bytes == nbytes, (counted.to_host_bytes, nbytes)
        assert counted.to_device_bytes == nbytes, (counted.to_device_bytes, nbytes)
        assert counted.largest <= CHUNK, counted.largest


async def test_not_in_place_the_total_is_made_on_the_device_once() -> None:
    """Sums still read elsewhere (not lent): the total is one new tensor on the gradient's
    device, the gradient untouched; still each element once each way."""
    flats = [torch.arange(5000, dtype=torch.float32) * (k + 1) for k in range(2)]
    copies = [CountingCopies() for _ in flats]
    given = [f.clone() for f in flats]
    async with replicas(2) as pool:
        results = await _round(pool, given, copies, in_place=False)
    for result, flat, before, counted in zip(results, given, flats, copies, strict=True):
        assert isinstance(result, torch.Tensor), repr(result)
        assert torch.equal(result, ordered_sum(flats))
        assert torch.equal(flat, before)
        assert counted.to_host_bytes == counted.to_device_bytes == flat.nbytes
        assert counted.largest <= CHUNK


@pytest.mark.parametrize("codec", [CODEC_FP16, CODEC_INT8_BLOCKWISE])
async def test_a_lossy_round_on_a_device_gives_the_cpus_bits(codec: int) -> None:
    """A lossy codec's parts go whole (one part's copy each), its sums come back a chunk at a
    time: every replica ends with the bits the same round gives on the CPU."""
    gen = torch.Generator().manual_seed(11)
    flats = [torch.randn(6000, generator=gen) for _ in range(3)]
    async with replicas(3) as pool:
        on_cpu = await _round(pool, [f.clone() for f in flats], [None] * 3, codec=codec)
    copies = [CountingCopies() for _ in flats]
    async with replicas(3) as pool:
        staged = await _round(pool, [f.clone() for f in flats], copies, codec=codec)
    for want, got, counted in zip(on_cpu, staged, copies, strict=True):
        assert isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor), (want, got)
        assert torch.equal(got, want)
        assert counted.to_device_bytes == flats[0].nbytes and counted.largest <= CHUNK


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
async def test_on_cuda_a_round_allocates_no_gradient_sized_device_memory() -> None:
    """Two replicas on cuda:0, each averaging a 16 MiB float32 gradient in place: the device's
    peak rises by far less than one gradient (before: a device copy of the total each), and the
    sum is bitwise the CPU's."""
    gen = torch.Generator().manual_seed(3)
    cpu = [torch.randn(4 << 20, generator=gen) for _ in range(2)]
    on_gpu = [t.to("cuda:0") for t in cpu]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    async with replicas(2) as pool:
        # torch's own copies (None), through the process's pinned buffers
        results = await _round(pool, on_gpu, [None, None], chunk_bytes=1 * MiB, slice_bytes=4 * MiB)
    torch.cuda.synchronize()
    grown = torch.cuda.max_memory_allocated() - base
    assert grown < cpu[0].nbytes // 4, f"{grown / MiB:.1f} MiB more device memory at the peak"
    want = ordered_sum(cpu)
    for result, flat in zip(results, on_gpu, strict=True):
        assert isinstance(result, torch.Tensor), repr(result)
        assert result.device.type == "cuda" and result.data_ptr() == flat.data_ptr()
        assert torch.equal(result.cpu(), want)


@needs_cuda
@pytest.mark.parametrize("on_disk", [True, False])
def test_on_cuda_a_spill_keeps_and_restores_a_device_gradient(tmp_path: Any, on_disk: bool) -> None:
    """What a retried round reads back after an in-place round on a cuda gradient."""
    flat = torch.randn(100_000, device="cuda:0")
    before = flat.clone()
    spill = Spill(flat, tmp_path if on_disk else None)
    for where in (slice(0, 30_000), slice(30_000, 100_000)):
        spill.keep(where)
        flat[where] = 1.0
    spill.restore()
    assert torch.equal(flat, before)
