"""The activation window's byte bound sized by the device (`swarm.device.sharing`): on a device
that says its free memory, a share of it split with the other servers on the device and checked
again before each entry is kept; the flag's as ever on a CPU; an operator's own bound kept, within
the device's free memory; and the microbatches it holds, said where the bound was sized."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from stage_server.peer.limits import PeerLimits
from stage_server.replica.activation_cache import ActivationCache
from swarm.device.activation_bytes import Footprint
from swarm.device.claims import Claims
from swarm.device.sharing import (
    CACHE_SHARE,
    TorchDeviceMemory,
    microbatches_held,
    window_for,
)
from swarm.device.standin import StandInMemory
from tests.support.cli import ROOT

DEFAULT = PeerLimits().max_activation_cache_bytes
GIB, MIB = 1 << 30, 1 << 20
CUDA = torch.device("cuda:0")


def card(free: int, total: int = 80 * GIB, name: str = "card-0") -> StandInMemory:
    """A stand-in device with `free` of `total` bytes free (the rest the stages' own state)."""
    return StandInMemory(total, name=name, used_elsewhere=total - free)


def test_on_a_device_that_says_its_free_memory_the_bound_is_a_share_of_it(tmp_path: Path) -> None:
    alone = window_for(DEFAULT, torch.device("cuda:1"), card(60 * GIB), Claims(tmp_path))
    assert alone.bytes == int(60 * GIB * CACHE_SHARE) and alone.sized
    small = card(3 * GIB, 8 * GIB, name="small")  # less than the fixed 4 GiB would have kept
    assert window_for(DEFAULT, CUDA, small, Claims(tmp_path), share=0.25).bytes == 3 * GIB // 4


def test_four_servers_on_one_device_share_it(tmp_path: Path) -> None:
    # Issue 63: each server took half the free memory it saw at start, so four servers on one
    # 80 GB card held bounds of about 150 GB. Now each takes an even part of one share.
    memory, claims = card(60 * GIB), Claims(tmp_path)
    windows = [window_for(DEFAULT, CUDA, memory, claims) for _ in range(4)]
    bounds = [w.bytes for w in windows]
    assert sum(bounds) <= 60 * GIB * CACHE_SHARE, [b / GIB for b in bounds]
    assert min(bounds) == max(bounds)  # even parts, whichever server started first
    other = window_for(DEFAULT, CUDA, card(60 * GIB, name="card-1"), claims)
    assert other.bytes == int(60 * GIB * CACHE_SHARE)  # another card is not shared
    windows[0].close()  # a server that stops gives its part back
    assert sum(w.bytes for w in windows[1:]) <= 60 * GIB * CACHE_SHARE
    assert windows[1].bytes > bounds[1]


def test_what_a_window_holds_stays_in_the_device_s_share(tmp_path: Path) -> None:
    # A window's bytes are on the device already: free memory falls as it fills, and the bound
    # counts them back, so the servers' parts do not shrink as their windows fill.
    memory, claims = card(60 * GIB), Claims(tmp_path)
    a, b = (window_for(DEFAULT, CUDA, memory, claims) for _ in range(2))
    part = a.bytes
    memory.allocate(10 * GIB)
    assert a.limit(10 * GIB, 1 * GIB) == part
    assert b.bytes == part


def test_a_claimant_killed_frees_its_claim(tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from swarm.device.claims import Claims
        claim = Claims(Path({str(tmp_path)!r})).claim("card-0")
        claim.publish({4 * GIB})
        print("claimed", flush=True)
        time.sleep(600)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"claimed"
        window = window_for(DEFAULT, CUDA, card(60 * GIB), Claims(tmp_path))
        shared = window.bytes
        assert shared == int((60 + 4) * GIB * CACHE_SHARE) // 2
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        assert window.bytes == int(60 * GIB * CACHE_SHARE)  # the dead one no longer counted
        assert [p.name for p in (tmp_path / "card-0").glob("*.claim")] == [
            window._claim.path.name  # type: ignore[attr-defined]
        ]  # ... and its file swept
    finally:
        child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()


def test_an_entry_is_not_kept_when_the_free_memory_read_again_is_short(tmp_path: Path) -> None:
    # Read once at start, the bound kept entries whatever the device had left since. Now the
    # free memory is read before each entry is kept: short of room for one more forward, the
    # oldest go, the new one too if need be, and never an out-of-memory error.
    memory = card(8 * GIB)
    window = window_for(DEFAULT, CUDA, memory, Claims(tmp_path))
    cache, one = ActivationCache(), 256 * MIB

    def forward(index: int) -> None:
        memory.allocate(one)  # what its graph holds on the device: here, its output
        out = torch.empty(one, dtype=torch.uint8, device="meta")
        cache.keep((0, index, ""), out, out, Footprint(), 64, window)

    for index in range(4):
        forward(index)
    assert len(cache) == 4 and cache.evictions == 0
    memory.used_elsewhere += 6 * GIB + GIB // 2  # another process, or weights loaded since
    reads = memory.reads
    forward(4)
    assert memory.reads > reads  # read again before the entry was kept
    free = memory.total - memory.used_elsewhere - cache.bytes
    assert free >= one, "room for one more forward"
    assert len(cache) == 3 and list(cache)[-1] == (0, 4, "")  # within half of what is left
    cache.clear()
    memory.used_elsewhere = memory.total  # no room beside it, nothing to drop: not kept
    forward(5)
    assert len(cache) == 0


def test_the_cpu_and_an_operator_s_own_bound_are_kept_as_they_are(tmp_path: Path) -> None:
    cpu = StandInMemory(0)
    cpu.free_and_total = lambda device: None  # type: ignore[method-assign]
    assert window_for(DEFAULT, torch.device("cpu"), cpu, Claims(tmp_path)).bytes == DEFAULT
    by_hand = window_for(123 * MIB, CUDA, card(60 * GIB), Claims(tmp_path))
    assert by_hand.bytes == 123 * MIB and by_hand.sized
    assert not list(tmp_path.iterdir())  # the operator's: no part of the device claimed
    assert by_hand.limit(0, 0) == 123 * MIB
    short = window_for(123 * MIB, CUDA, card(60 * MIB), Claims(tmp_path))
    assert short.limit(50 * MIB, 10 * MIB) == 50 * MIB + 60 * MIB - 10 * MIB  # within free


def test_the_real_memory_of_a_cpu_says_nothing(tmp_path: Path) -> None:
    assert TorchDeviceMemory().free_and_total(torch.device("cpu")) is None
    assert TorchDeviceMemory().allocated(torch.device("cpu")) is None
    window = window_for(DEFAULT, torch.device("cpu"), claims=Claims(tmp_path))
    assert window.bytes == DEFAULT and not window.sized


def test_what_a_card_holds_is_its_share_over_a_microbatch_within_the_count(
    tmp_path: Path,
) -> None:
    big = window_for(DEFAULT, CUDA, card(60 * GIB), Claims(tmp_path / "a")).bytes  # 30 GiB
    assert microbatches_held(64, big, 512 * MIB) == 60
    assert microbatches_held(40, big, 512 * MIB) == 40  # the job's count bound first
    small = window_for(DEFAULT, CUDA, card(3 * GIB, 8 * GIB), Claims(tmp_path / "b")).bytes
    assert microbatches_held(64, small, 512 * MIB) == 3  # 1.5 GiB
    assert microbatches_held(64, small, 2 * GIB) == 1  # none kept: the one computed is held
    assert microbatches_held(64, big, 0) == 0  # nothing measured yet: not said


def test_a_bound_is_sized_by_a_device_that_says_or_by_the_operator_not_by_the_default(
    tmp_path: Path,
) -> None:
    claims = Claims(tmp_path)
    assert window_for(DEFAULT, CUDA, card(60 * GIB), claims).sized
    assert not window_for(DEFAULT, torch.device("cpu"), claims=claims).sized  # torch's answer
    assert window_for(123 * MIB, torch.device("cpu"), claims=claims).sized


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_real_bound_is_a_share_of_mem_get_info(tmp_path: Path) -> None:
    device = torch.device("cuda:0")
    free, total = torch.cuda.mem_get_info(device)
    window = window_for(DEFAULT, device, claims=Claims(tmp_path))
    assert 0 < window.bytes <= free * CACHE_SHARE * 1.05 and window.bytes < total
    assert TorchDeviceMemory().identity(device).startswith("cuda-")
