"""A live stage server (real gRPC on a free port) never applies a non-finite gradient: PREPARE
reports its norm as it is (the coordinator fails the job on it), and APPLY refuses it, clipping
or not, with the parameters left as they were and the refusal counted."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch

from stage_server.server import RunningStageServer
from swarm.errors import NonFiniteGradient, SwarmError
from swarm.proto import stage_pb2 as pb
from swarm.rpc.stage_client import StageClient, as_tensor
from swarm.wire.crossing import Crossing

pytestmark = pytest.mark.timeout(60)


async def _poisoned_backward(client: StageClient, bad: float) -> None:
    """Microbatch 0 of step 0, whose output gradient (a trainer's, or a later stage's) holds
    one `bad` value: the stage's parameter gradients are NaN or infinite."""
    out = as_tensor(
        await client.forward(0, 0, Crossing(torch.randn(4, 16, 32, dtype=torch.float64)))
    )
    grad = torch.ones_like(out)
    grad[0, 0, 0] = bad
    await client.backward(0, 0, None, grad)


def _refused(server: RunningStageServer) -> float | None:
    return server.servicer.metrics.registry.get_sample_value(
        "swarm_stage_nonfinite_gradients_total",
        {"job": server.servicer.job_id, "stage": "1", "peer": server.servicer.peer},
    )


@pytest.mark.parametrize("bad", [math.nan, math.inf])
async def test_apply_without_clipping_refuses_a_non_finite_gradient(
    server: RunningStageServer, client: StageClient, bad: float
) -> None:
    before = {k: v.clone() for k, v in server.runtime.state_dict().items()}
    await _poisoned_backward(client, bad)
    # Before: the commit answered step 1 and every parameter the gradient reached was NaN.
    with pytest.raises(NonFiniteGradient, match=r"stage 1 step 0: .*NaN or infinite"):
        await client.commit(0, [0], 4)  # prepare and apply at once: a job without grad_clip
    after = server.runtime.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # nothing was applied
    assert server.runtime.step == 0 and (await client.info()).step == 0
    assert _refused(server) == 1.0


async def test_prepare_reports_the_non_finite_norm_and_apply_refuses_it(
    server: RunningStageServer, client: StageClient
) -> None:
    before = {k: v.clone() for k, v in server.runtime.state_dict().items()}
    await _poisoned_backward(client, math.nan)
    prepared = await client.commit(0, [0], 4, phase=pb.COMMIT_PHASE_PREPARE)
    assert math.isnan(prepared.grad_sq_norm)  # for the coordinator to see, and fail the job on
    with pytest.raises(NonFiniteGradient):  # a coordinator that sent APPLY all the same
        await client.commit(0, [], 0, phase=pb.COMMIT_PHASE_APPLY, grad_scale=1.0)
    after = server.runtime.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert server.runtime.step == 0 and _refused(server) == 1.0  # counted once, at PREPARE


async def test_apply_refuses_a_non_finite_gradient_it_did_not_see_prepared(
    server: RunningStageServer, client: StageClient
) -> None:
    """Sums prepared by no Commit this replica answered (its runtime's own path): APPLY takes
    their norm itself rather than trust none."""
    rt = server.runtime
    sums = [torch.zeros_like(p) for p in rt.params]
    sums[-1].view(-1)[0] = math.inf
    rt.set_prepared(0, sums, 4)
    with pytest.raises(NonFiniteGradient, match="stage 1 step 0"):
        await client.commit(0, [], 0, phase=pb.COMMIT_PHASE_APPLY, grad_scale=0.5)
    assert rt.step == 0 and _refused(server) == 1.0


@pytest.mark.parametrize(
    ("eager", "phase", "round_end", "refusal"),
    [
        (pb.EAGER_STEP, pb.COMMIT_PHASE_APPLY, False, "round_end must be set"),
        (pb.EAGER_STEP, pb.COMMIT_PHASE_PREPARE, True, "no operation 1 in phase PREPARE"),
        (pb.EAGER_MEAN, pb.COMMIT_PHASE_BOTH, True, "no operation 4 in phase PREPARE"),
        (9, pb.COMMIT_PHASE_APPLY, True, "no operation 9"),
        (pb.EAGER_AVERAGE, pb.COMMIT_PHASE_PREPARE, True, 'pool.overlap = "eager"'),
    ],
)
async def test_an_eager_operation_out_of_place_is_refused(
    client: StageClient,
    server: RunningStageServer,
    eager: int,
    phase: int,
    round_end: bool,
    refusal: str,
) -> None:
    """A round's eager operations only as the coordinator sends them (a round's end, each in
    its phase, on a job with pool.overlap = "eager"); this job averages every step."""
    with pytest.raises(SwarmError, match=re.escape(refusal)):
        await client.commit(2, [], 8, phase=phase, round_end=round_end, eager=eager)
    assert server.runtime.step == 0


async def test_a_replica_alone_prepares_in_one_call_on_its_worker(
    server: RunningStageServer, client: StageClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool of one (the coordinator's PREPARE names no group) averages nothing: its PREPARE
    is one hand-off to the worker, not four (issue 69), and refuses a short ledger as before,
    with the averager told and nothing prepared."""
    out = as_tensor(
        await client.forward(0, 0, Crossing(torch.randn(4, 16, 32, dtype=torch.float64)))
    )
    await client.backward(0, 0, None, torch.ones_like(out))
    worker, calls = server.servicer.worker, []
    run = worker._run

    async def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[1])
        return await run(*args, **kwargs)

    monkeypatch.setattr(worker, "_run", counted)
    with pytest.raises(SwarmError, match=r"receipts missing for microbatches \[1\]"):
        await client.commit(0, [0, 1], 8, phase=pb.COMMIT_PHASE_PREPARE)
    with pytest.raises(SwarmError, match="step 0 was not prepared"):
        await client.commit(0, [], 0, phase=pb.COMMIT_PHASE_APPLY, grad_scale=1.0)
    calls.clear()
    prepared = await client.commit(0, [0], 4, phase=pb.COMMIT_PHASE_PREPARE)
    assert len(calls) == 1  # the sums kept and their norm taken in the same call
    rt = server.runtime
    assert prepared.grad_sq_norm == rt.prepared_sq_norm(0) > 0.0
    before = [p.clone() for p in rt.params]
    await client.commit(0, [], 0, phase=pb.COMMIT_PHASE_APPLY, grad_scale=1.0)
    assert rt.step == 1
    assert not all(torch.equal(a, b) for a, b in zip(before, rt.params, strict=True))
