"""A subspace boundary (`model.boundary_rank`) at the stage runtime: stages that exchange only
coefficients and token ids, recomputing from them on Backward as another replica would, train
`swarm local`'s constrained model; a stage refuses what a peer of another boundary sends, by
name, rather than computing with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stage_server.replica.runtime import StageRuntime
from swarm.errors import InvalidArgument
from swarm.model.data import make_data
from swarm.model.subspace import wire_targets, wire_tokens
from swarm.wire.crossing import Crossing
from tests.support.equality import assert_states_within, local_state
from tests.support.jobs import make_job

RANK = 4


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_stages_exchanging_coefficients_equal_local_training(tmp_path: Path, kind: str) -> None:
    job = make_job(tmp_path, model={"kind": kind, "boundary_rank": RANK})
    runtimes = [StageRuntime(job, k) for k in range(job.training.stages)]
    data, m = make_data(job), job.training.microbatches_per_step
    for step in range(job.training.steps):
        samples = 0
        for index in range(m):
            ids, targets = data.microbatch(step, index)
            tokens = wire_tokens(ids, job.model.vocab_size)  # as they travel
            boundary = [ids]
            for rt in runtimes[:-1]:
                out = rt.forward(step, index, Crossing(boundary[-1], tokens))
                assert out.shape[-1] == RANK  # r coefficients per token cross, not d_model
                boundary.append(out)
                rt._cache.clear()  # Backward recomputes from the coefficients and token ids
            _, grad, _ = runtimes[-1].forward_backward(
                step, index, Crossing(boundary[-1], tokens), targets
            )
            for k in range(len(runtimes) - 2, -1, -1):
                assert grad is not None and grad.shape[-1] == RANK  # and r come back
                grad, _ = runtimes[k].backward(
                    step, index, Crossing(boundary[k], tokens), grad, need_grad_inputs=k > 0
                )
            samples += int(ids.shape[0])
        for rt in runtimes:
            assert rt.commit(step, list(range(m)), samples) is False
    swarm: dict[str, torch.Tensor] = {}
    for rt in runtimes:
        swarm.update(rt.state_dict())
    assert_states_within(swarm, local_state(job), tol=1e-12)


def test_peers_of_another_boundary_are_refused_by_name(tmp_path: Path) -> None:
    subspace = make_job(tmp_path, "sub", model={"boundary_rank": RANK})
    full = make_job(tmp_path, "full")
    ids = torch.zeros(4, 16, dtype=torch.int64)
    coefficients = torch.zeros(4, 16, RANK, dtype=torch.float64)
    wide = torch.zeros(4, 16, 32, dtype=torch.float64)
    # a full-boundary stage sent coefficients, a subspace stage sent a full residual
    with pytest.raises(InvalidArgument, match=r"\[batch, seq, 32\]"):
        StageRuntime(full, 1).forward(0, 0, Crossing(coefficients))
    with pytest.raises(InvalidArgument, match=rf"\[batch, seq, {RANK}\]"):
        StageRuntime(subspace, 1).forward(0, 0, Crossing(wide, ids))
    # a subspace stage sent no token ids, or ids of another shape
    with pytest.raises(InvalidArgument, match=r"model.boundary_rank = 4 needs .* token ids"):
        StageRuntime(subspace, 1).forward(0, 0, Crossing(coefficients))
    with pytest.raises(InvalidArgument, match="tokens must be int64"):
        StageRuntime(subspace, 2).forward(0, 0, Crossing(coefficients, ids[:, :3]))
    last = StageRuntime(subspace, 3)
    with pytest.raises(InvalidArgument, match="token ids"):
        last.forward_backward(0, 0, Crossing(coefficients), ids)


@pytest.mark.parametrize("bad", [-1, 64])
def test_token_ids_outside_the_vocabulary_are_refused_before_any_lookup(
    tmp_path: Path, bad: int
) -> None:
    rt = StageRuntime(make_job(tmp_path, model={"boundary_rank": RANK}), 1)
    tokens = torch.zeros(4, 16, dtype=torch.int32)
    tokens[2, 5] = bad  # would index past the fixed table (or wrap around)
    with pytest.raises(InvalidArgument, match=r"tokens must lie in \[0, 64\)"):
        rt.forward(0, 0, Crossing(torch.zeros(4, 16, RANK, dtype=torch.float64), tokens))


def test_the_last_stage_takes_the_targets_as_narrow_as_the_push_plane_sends_them(
    tmp_path: Path,
) -> None:
    """Under a subspace boundary the targets ride every hop beside a few coefficients per
    token: they travel as narrow as the token ids, and give the same loss; a full boundary's
    last stage still takes int64 alone (its peers may predate the narrow form)."""
    job = make_job(tmp_path, "sub", model={"boundary_rank": RANK})
    ids = make_data(job).microbatch(0, 0)[1]
    narrow = wire_targets(ids, RANK, job.model.vocab_size)
    assert narrow.dtype == torch.uint8
    c = torch.randn(ids.shape[0], ids.shape[1], RANK, dtype=torch.float64)
    last = StageRuntime(job, job.training.stages - 1)
    tokens = wire_tokens(ids, job.model.vocab_size)
    given = Crossing(c, tokens)
    assert last.evaluate(0, given, narrow) == last.evaluate(0, given, ids)
    full = make_job(tmp_path, "full")
    assert wire_targets(ids, 0, full.model.vocab_size) is ids
    x = torch.zeros(ids.shape[0], ids.shape[1], full.model.d_model, dtype=torch.float64)
    with pytest.raises(InvalidArgument, match="targets must be int64"):
        StageRuntime(full, full.training.stages - 1).evaluate(0, Crossing(x), narrow)
