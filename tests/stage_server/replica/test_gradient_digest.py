"""The digest of a microbatch's parameter gradient (`stage_server.replica.gradient_digest`), an
audit's re-execution that accumulates nothing: the same as the checksum of what an accumulating
backward adds into the replica's sums, so the digests of its microbatches add up to its
contribution's."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from stage_server.averaging.checksum import dots
from stage_server.averaging.flat import flatten
from stage_server.replica.runtime import StageRuntime
from swarm.model.data import make_data
from swarm.wire.crossing import Crossing
from tests.support.jobs import make_job

SEED = 0x5EED


@pytest.mark.parametrize("stage", [0, 1])
def test_a_digest_is_the_checksum_of_what_a_backward_accumulates(
    tmp_path: Path, stage: int
) -> None:
    job = make_job(tmp_path, training={"stages": 2, "dtype": "float64"})
    rts = [StageRuntime(job, k) for k in range(2)]
    audit = StageRuntime(job, stage)  # another replica of the stage: the same parameters
    inputs, targets = make_data(job).microbatch(0, 0)
    hidden = rts[0].forward(0, 0, Crossing(inputs))
    if stage == 1:
        _, grad_x, _ = rts[1].forward_backward(0, 0, Crossing(hidden), targets)
        _, _, receipt = audit.forward_backward(
            0, 0, Crossing(hidden), targets, accumulate=False, digest_seed=SEED
        )
    else:
        _, grad_x, _ = rts[1].forward_backward(0, 0, Crossing(hidden), targets)
        rts[0].backward(0, 0, Crossing(inputs), grad_x, need_grad_inputs=False)
        audit.forward(0, 0, Crossing(inputs))
        _, receipt = audit.backward(
            0, 0, None, grad_x, accumulate=False, need_grad_inputs=False, digest_seed=SEED
        )
    assert receipt.digest is not None
    accumulated = flatten(rts[stage].sums.accum_or_zeros(0))
    dot, magnitude, squares = dots(SEED, 0, accumulated)
    assert receipt.digest == (dot, magnitude, math.sqrt(squares))  # bit for bit, on the CPU
    assert audit.receipts(0) == {}  # nothing accumulated there
    if stage == 1:  # none asked, none computed
        _, _, plain = audit.forward_backward(0, 1, Crossing(hidden), targets, accumulate=False)
        assert plain.digest is None
