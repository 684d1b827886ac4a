"""A live stage server (real gRPC on a free port): a call of step t+1 that arrives after this
replica answered its PREPARE of step t, before the APPLY, waits for the APPLY and computes on the
updated parameters (issue 69: the coordinator opens the next step once the step is decided).
Anything else of a step not started here is refused as before: at a replica that prepared
nothing, and once what it prepared is discarded. The wait itself is bounded
(`PendingApply.wait`)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import torch

from stage_server.replica.pending_apply import PendingApply
from stage_server.server import RunningStageServer, StageServerOptions, start_stage_server
from swarm.errors import FailedPrecondition
from swarm.job.fingerprint import fingerprint
from swarm.proto import stage_pb2 as pb
from swarm.rpc.stage_client import StageClient, as_tensor
from swarm.wire.crossing import Crossing
from tests.support.jobs import DELAYED, make_job

pytestmark = pytest.mark.timeout(60)


def _inputs() -> torch.Tensor:
    return torch.randn(4, 16, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(7))


async def _prepared(client: StageClient) -> torch.Tensor:
    """Step 0's one microbatch computed and PREPAREd; the outputs of `_inputs()` before it."""
    before = as_tensor(await client.forward(0, 1, Crossing(_inputs()), evaluate=True))
    out = as_tensor(await client.forward(0, 0, Crossing(_inputs())))
    await client.backward(0, 0, None, torch.ones_like(out))
    await client.commit(0, [0], 4, phase=pb.COMMIT_PHASE_PREPARE)
    return before


async def test_a_call_of_the_next_step_waits_for_the_apply_and_computes_after_it(
    server: RunningStageServer, client: StageClient
) -> None:
    before = await _prepared(client)
    ahead = asyncio.create_task(client.forward(1, 0, Crossing(_inputs())))
    await asyncio.sleep(0.2)  # it reaches the replica (a slower one only waits longer)
    # Before: refused at once, "stage 1 is at step 0; step 1 has not started here".
    assert not ahead.done(), f"answered before the APPLY: {ahead.exception()!r}"
    await client.commit(0, [], 0, phase=pb.COMMIT_PHASE_APPLY, grad_scale=1.0)
    waited = as_tensor(await asyncio.wait_for(ahead, 30))
    after = as_tensor(await client.forward(1, 1, Crossing(_inputs()), evaluate=True))
    assert server.runtime.step == 1
    assert torch.equal(waited, after) and not torch.equal(waited, before)


async def test_a_call_of_a_step_not_started_is_refused_where_nothing_was_prepared(
    server: RunningStageServer, client: StageClient
) -> None:
    with pytest.raises(FailedPrecondition, match="step 1 has not started here"):
        await client.forward(1, 0, Crossing(_inputs()))
    assert server.runtime.step == 0


async def test_a_waiting_call_is_refused_once_what_was_prepared_is_discarded(
    server: RunningStageServer, client: StageClient
) -> None:
    await _prepared(client)
    ahead = asyncio.create_task(client.forward(1, 0, Crossing(_inputs())))
    await asyncio.sleep(0.2)
    await client.discard(0)  # voided: no APPLY of step 0 will come here
    with pytest.raises(FailedPrecondition, match="step 1 has not started here"):
        await asyncio.wait_for(ahead, 30)
    assert server.runtime.step == 0


async def test_under_delayed_update_the_next_step_computes_before_the_apply(
    tmp_path: Path,
) -> None:
    """delayed_update's step t+1 computes on the parameters before step t's update: it never
    waits for that APPLY (its overlap with the commit is the rule's whole point)."""
    job = make_job(tmp_path, "delayed", training={"stages": 3, **DELAYED})
    server = await start_stage_server(job, StageServerOptions(stage=1))
    client = StageClient(server.address, job, fingerprint(job), 1)
    try:
        await _prepared(client)
        served = await asyncio.wait_for(client.forward(1, 0, Crossing(_inputs())), 30)
        assert as_tensor(served).shape == (4, 16, 32) and server.runtime.step == 0
    finally:
        await client.close()
        await server.stop()


async def test_the_wait_is_bounded_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    await PendingApply().wait(lambda: True, 0.05, "peer: a call of step 3")
    assert "peer: a call of step 3 waited 0 s for its step's APPLY" in caplog.text


async def test_a_call_after_a_rollback_to_the_prepared_step_is_refused_at_once(
    server: RunningStageServer, client: StageClient
) -> None:
    """A rollback to the step this replica prepared and applied (the job went back to before
    it: a liar banned, say) leaves what it prepared on record with the replica at that step
    again. No APPLY of it is on its way: a call of the next step, of the abandoned trajectory,
    is refused at once, as before the early opening. Before: it waited the APPLY's deadline
    (the job's `rpc_timeout_s`, 60 s), and the replay with it."""
    await _prepared(client)
    state = server.runtime.export_state()  # the state of step 0, as the rollback sends it
    await client.commit(0, [], 0, phase=pb.COMMIT_PHASE_APPLY, grad_scale=1.0)
    assert await client.load_state(0, state, rollback_epoch=1) == 0
    with pytest.raises(FailedPrecondition, match="step 1 has not started here"):
        await asyncio.wait_for(client.forward(1, 0, Crossing(_inputs())), 10)
    assert server.runtime.step == 0
