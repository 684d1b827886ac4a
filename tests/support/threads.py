"""One torch thread in the test process, before every test.

The test process does its torch work on one thread, as stage servers do (`--threads 1`): beside
the swarm processes a test starts (and the other xdist worker) on 2 cores, torch's second thread
only contends, and under contention its OpenMP threads spin at every parallel region's barrier
waiting for a thread that is not running. The reference training of the uneven-pools test's
job (24 steps of 192 samples, float64): 4.9-5.3 s of CPU on one thread, 58-86 s on two, with
two such runs at once.

Set before every test, not once a session: a test that runs `swarm local` in this process (its
`main`, whose default is every core: `swarm.commands`) left its worker on two threads for the
rest of the run, and every later test's torch work there paid for it. At most the order of some
float additions changes; every comparison keeps its tolerance."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

__all__ = ["one_torch_thread"]


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    import torch

    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    yield
