"""The activation cache's byte bound sized by the device (`swarm.device.sharing`):
a share of the free device memory on CUDA, the flag's as ever on a CPU and wherever the
operator set it; and the microbatches it holds, said where the bound was sized for the peer."""

from __future__ import annotations

import pytest
import torch

from stage_server.peer.limits import PeerLimits
from swarm.device.sharing import (
    CACHE_SHARE,
    TorchDeviceMemory,
    cache_bytes,
    microbatches_held,
    sized,
)

DEFAULT = PeerLimits().max_activation_cache_bytes
GIB = 1 << 30


class FakeMemory:
    """A device that says it has `free` of `total` bytes (None: it cannot say)."""

    def __init__(self, known: tuple[int, int] | None) -> None:
        self.known = known
        self.asked: list[torch.device] = []

    def free_and_total(self, device: torch.device) -> tuple[int, int] | None:
        self.asked.append(device)
        return self.known


def test_on_a_device_that_says_its_free_memory_the_bound_is_a_share_of_it() -> None:
    card = FakeMemory((60 * GIB, 80 * GIB))
    assert cache_bytes(DEFAULT, torch.device("cuda:1"), card) == int(60 * GIB * CACHE_SHARE)
    assert card.asked == [torch.device("cuda:1")]
    small = FakeMemory((3 * GIB, 8 * GIB))  # less than the fixed 4 GiB would have kept
    assert cache_bytes(DEFAULT, torch.device("cuda:0"), small, share=0.25) == 3 * GIB // 4


def test_a_second_server_on_the_card_takes_a_share_of_what_the_first_left() -> None:
    free, total = 60 * GIB, 80 * GIB
    first = cache_bytes(DEFAULT, torch.device("cuda:0"), FakeMemory((free, total)))
    second = cache_bytes(DEFAULT, torch.device("cuda:0"), FakeMemory((free - first, total)))
    assert first + second < free  # the shares never add up past what was free


def test_the_cpu_and_an_operator_s_own_bound_are_kept_as_they_are() -> None:
    assert cache_bytes(DEFAULT, torch.device("cpu"), FakeMemory(None)) == DEFAULT
    card = FakeMemory((60 * GIB, 80 * GIB))
    assert cache_bytes(123 << 20, torch.device("cuda:0"), card) == 123 << 20
    assert card.asked == []  # the flag, as given: the device is not even asked


def test_the_real_memory_of_a_cpu_says_nothing() -> None:
    assert TorchDeviceMemory().free_and_total(torch.device("cpu")) is None
    assert cache_bytes(DEFAULT, torch.device("cpu")) == DEFAULT


def test_what_a_card_holds_is_its_share_over_a_microbatch_within_the_count() -> None:
    mib, cuda = 1 << 20, torch.device("cuda:0")
    big = cache_bytes(DEFAULT, cuda, FakeMemory((60 * GIB, 80 * GIB)))  # 30 GiB
    assert microbatches_held(64, big, 512 * mib) == 60
    assert microbatches_held(40, big, 512 * mib) == 40  # the job's count bound first
    small = cache_bytes(DEFAULT, cuda, FakeMemory((3 * GIB, 8 * GIB)))  # 1.5 GiB
    assert microbatches_held(64, small, 512 * mib) == 3
    assert microbatches_held(64, small, 2 * GIB) == 1  # none kept: the one computed is held
    assert microbatches_held(64, big, 0) == 0  # nothing measured yet: not said


def test_a_bound_is_sized_by_a_device_that_says_or_by_the_operator_not_by_the_default() -> None:
    assert sized(DEFAULT, torch.device("cuda:0"), FakeMemory((60 * GIB, 80 * GIB)))
    assert not sized(DEFAULT, torch.device("cpu"), FakeMemory(None))
    assert not sized(DEFAULT, torch.device("cpu"))  # torch's own answer on a CPU
    card = FakeMemory(None)
    assert sized(123 << 20, torch.device("cpu"), card) and card.asked == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_real_bound_is_a_share_of_mem_get_info() -> None:
    device = torch.device("cuda:0")
    free, total = torch.cuda.mem_get_info(device)
    bound = cache_bytes(DEFAULT, device)
    assert 0 < bound <= free * CACHE_SHARE * 1.05 and bound < total
