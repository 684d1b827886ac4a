"""The owner's words about what each sender sent (issue 55; `Averager.on_summing`,
`PartChecks.summing`): r·x and Σ|r·x| of every contribution as the averager sums it, which the
coordinator holds each sender's own word about what it sent to (`scheduler.coordinator.
sent_words`). An honest pair must agree to the bit: the same values, the same r, the same
blocks, whichever sends first and however the part is sliced."""

from __future__ import annotations

import asyncio
import math

import torch

from stage_server.averaging.checksum import BLOCK, AuditedChecks, Draws, dots, received_dots
from stage_server.averaging.owner import Averager

N = BLOCK + 4_321  # two blocks of r, the second partial
ROUND = ("job", 0, "1/0")


async def test_the_owner_says_what_each_sender_sent_as_the_sender_says_it() -> None:
    g = torch.Generator().manual_seed(3)
    values = [torch.randn(N, generator=g, dtype=torch.float64) for _ in range(3)]
    owner = AuditedChecks(7, [11, 13])  # member 0, owning part 0, given two audit seeds
    senders = [AuditedChecks(7, [11, 13]) for _ in range(3)]
    averager = Averager()
    halves = [slice(0, BLOCK - 5), slice(BLOCK - 5, N)]  # slices that cut a block of r
    averager.on_summing(ROUND, lambda k, j, vs: owner.summing(k, halves[j].start, vs))
    for i, checks in enumerate(senders):
        for where in halves:
            (owner if i == 0 else checks).contributed(0, where.start, values[i][where])
    calls = [
        averager.reduce(ROUND, 0, s, 3, values[s][where].clone(), timeout_s=5, slice=j)
        for s in (2, 0, 1)
        for j, where in enumerate(halves)
    ]
    await asyncio.gather(*calls)
    averager.on_summing(ROUND, None)
    mine = next(c for c in owner.report() if c.part == 0)
    said = [
        next(c for c in (owner if i == 0 else senders[i]).report() if c.part == 0) for i in range(3)
    ]
    assert list(mine.received_dots) == [c.dot for c in said]
    assert list(mine.received_magnitudes) == [c.magnitude for c in said]
    for seed_index in (0, 1):  # and under each audit seed
        audit = [c for c in owner.audit_report() if c.seed_index == seed_index and c.part == 0]
        theirs = [
            next(
                c
                for c in (owner if i == 0 else senders[i]).audit_report()
                if c.seed_index == seed_index and c.part == 0
            )
            for i in range(3)
        ]
        assert list(audit[0].received_dots) == [c.dot for c in theirs]
    # a replica that owns no part says no words
    assert all(not c.received_dots for c in senders[1].report())


def test_infinities_over_a_parts_blocks_make_its_words_nan_and_raise_nothing() -> None:
    """A sender's +inf in one block of r and -inf in another (r's signs as they fall): each
    block's dot is infinite, of either sign, and `math.fsum` of them raised ValueError in the
    owner's summing, aborting its round and naming the honest owner. Now its words are NaN,
    which the coordinator reads as this sender's NaN against whatever it says itself."""
    x = torch.zeros(N, dtype=torch.float64)
    x[0], x[BLOCK] = float("inf"), float("-inf")
    for seed in range(64):  # seeds whose r gives the two blocks' dots opposite signs among them
        assert not any(map(math.isfinite, received_dots(0, [x.clone()], Draws(seed))[0]))
        assert not any(map(math.isfinite, dots(seed, 0, x.clone())))
