"""A contribution whose own wait runs out while its slice is being summed names only the
senders that never came: the sum had all of them. It named every sender (the values that came
are taken out of the slice as the sum begins), and the round's other open slices were aborted
naming them all, each an honest member that had sent."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch

from stage_server.averaging.owner import Averager, AveragingAborted
from stage_server.averaging.summing import sum_in_order

pytestmark = pytest.mark.timeout(30)

ROUND = ("job", 0, "r0")


async def test_a_wait_that_ends_while_the_sum_runs_names_no_sender_that_came() -> None:
    averager = Averager()

    def slow(*args: Any) -> Any:  # a large part's sum, on its thread
        time.sleep(0.5)
        return sum_in_order(*args)

    averager.summer = slow
    v = torch.ones(4)

    def reduce(sender: int, slice: int, timeout_s: float) -> Any:
        return averager.reduce(ROUND, 0, sender, 2, v, timeout_s=timeout_s, slice=slice)

    # slice 1 is open (sender 0 came, sender 1 is on its way); slice 0 has both and sums slowly
    later = asyncio.ensure_future(reduce(0, 1, 5.0))
    patient = asyncio.ensure_future(reduce(1, 0, 5.0))
    with pytest.raises(AveragingAborted) as e:
        await reduce(0, 0, 0.2)  # its own deadline ends while slice 0 sums
    assert not e.value.missing, e.value.missing
    await patient  # the other sender of slice 0 gets its sum
    done = asyncio.ensure_future(reduce(1, 1, 5.0))
    reduced = await asyncio.gather(later, done, return_exceptions=True)
    assert not [r for r in reduced if isinstance(r, BaseException)], reduced
