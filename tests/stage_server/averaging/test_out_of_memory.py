"""A replica out of memory in its pool's round (real gRPC replicas on 127.0.0.1): it fails with
the out-of-memory error itself (its commit answers it, naming it: the coordinator leaves it out
of the retry), and every other member aborts at once naming it, not at the round's timeout."""

from __future__ import annotations

import time
from typing import NoReturn

import pytest
import torch

from stage_server.averaging.owner import AveragingAborted
from swarm.device.oom import is_out_of_memory, out_of_memory
from tests.support.pools import fail_in_round, reduce_all, replicas

TIMEOUT_S = 30.0  # far above the round's work: a member waiting it out fails the test
pytestmark = pytest.mark.timeout(120)


def _out_of_memory(where: str) -> NoReturn:
    raise out_of_memory(f"CUDA out of memory (the test's, {where})")


@pytest.mark.parametrize("where", ["own part", "owner's sum"])
async def test_a_member_out_of_memory_fails_itself_and_the_others_name_it_at_once(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing = 1
    async with replicas(3) as pool:
        fail_in_round(monkeypatch, pool[failing].averager, where, _out_of_memory)
        start = time.monotonic()
        results = await reduce_all(
            pool, [torch.randn(1001, dtype=torch.float64) for _ in pool], timeout_s=TIMEOUT_S
        )
        took = time.monotonic() - start
    assert took < TIMEOUT_S / 3, took
    for i, result in enumerate(results):
        assert isinstance(result, BaseException), result
        if i == failing and where == "own part":
            # Before: an AveragingAborted that named no one (an out-of-memory error of its own
            # read as a refused contribution), for the coordinator to take as intact.
            assert is_out_of_memory(result), repr(result)
        else:
            assert isinstance(result, AveragingAborted), repr(result)
            if i != failing:  # the others name it; it names no one
                assert failing in result.missing, (i, repr(result))
            else:
                assert result.missing == (), repr(result)
