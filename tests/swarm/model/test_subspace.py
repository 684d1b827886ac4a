"""The subspace boundary (`model.boundary_rank`): a stage's output is exactly what the next stage
rebuilds from the coefficients and the token ids, the stages chained give the whole model's
logits and every parameter gradient the whole (constrained) model has, for both families; the
basis is the job's and every process builds the same; bad ranks are refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from swarm.errors import ConfigError
from swarm.job.fingerprint import fingerprint
from swarm.model.subspace import wire_tokens
from swarm.model.transformer import (
    StageModule,
    build_model,
    build_stage,
    loss_sum,
    precision,
    subspace_of,
)
from tests.support.jobs import make_job

RANK = 4


def _job(tmp_path: Path, kind: str = "gpt", stages: int = 3, **model: Any) -> Any:
    shape: dict[str, Any] = {"kind": kind, "n_layers": 4, "boundary_rank": RANK, **model}
    return make_job(tmp_path, model=shape, training={"stages": stages})


def _batch(job: Any) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    cfg = job.model
    ids = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len), generator=gen)
    return ids, torch.randint(0, cfg.vocab_size, (3, cfg.seq_len), generator=gen)


def _chain(
    stages: list[StageModule], ids: torch.Tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The stages run as the swarm runs them: each takes the last one's output as a leaf (a
    stage server's input is one) and the token ids. Returns each stage's input and output."""
    leaves, outs = [], []
    x: torch.Tensor = ids
    for k, stage in enumerate(stages):
        leaf = x if k == 0 else x.detach().requires_grad_(True)
        x = stage(leaf, ids) if k else stage(leaf)
        leaves.append(leaf)
        outs.append(x)
    return leaves, outs


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_what_crosses_a_boundary_is_rank_coefficients_and_rebuilds_the_residual(
    tmp_path: Path, kind: str
) -> None:
    job = _job(tmp_path, kind)
    stages = [build_stage(job, k) for k in range(3)]
    ids, _ = _batch(job)
    _, outs = _chain(stages, ids)
    sub, whole = subspace_of(job), build_model(job)
    assert sub is not None
    h: torch.Tensor = ids
    for k, stage in enumerate(stages[:-1]):
        for i in stage.indices:  # the stage's layers at full width, as `swarm local` runs them
            h = whole.layers[str(i)](h)
        c = outs[k]
        assert c.shape == (3, job.model.seq_len, RANK)
        # The stage's output is exactly what the next stage rebuilds from c and the token ids.
        torch.testing.assert_close(sub.decode(c, ids), h, rtol=0, atol=1e-12)
        assert (h - sub.fixed(ids)).norm() > 1e-3  # not trivially the table


@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("table", [None, 0.0, 0.5])  # any table std keeps the boundary exact
def test_the_stages_give_the_whole_models_logits_and_gradients(
    tmp_path: Path, kind: str, table: float | None
) -> None:
    job = _job(tmp_path, kind, **({} if table is None else {"boundary_table": table}))
    ids, targets = _batch(job)
    whole = build_model(job)
    loss_sum(whole(ids), targets).backward()
    stages = [build_stage(job, k) for k in range(3)]
    leaves, outs = _chain(stages, ids)
    loss_sum(outs[-1], targets).backward()
    for k in range(len(stages) - 2, -1, -1):  # each stage hands the gradient of its input on
        g = leaves[k + 1].grad
        assert g is not None and g.shape[-1] == RANK  # the backward carries r values too
        outs[k].backward(g)
    theirs = dict(whole.named_parameters())
    for stage in stages:
        for name, p in stage.named_parameters():
            assert p.grad is not None and theirs[name].grad is not None, name
            torch.testing.assert_close(p.grad, theirs[name].grad, rtol=0, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(outs[-1], whole(ids), rtol=0, atol=1e-12)


def test_under_bf16_mixed_the_boundary_is_the_jobs_dtype_and_close_to_the_whole_model(
    tmp_path: Path,
) -> None:
    job = make_job(
        tmp_path,
        model={"n_layers": 4, "boundary_rank": RANK},
        training={"stages": 3, "dtype": "float32", "precision": "bf16-mixed"},
    )
    ids, targets = _batch(job)
    stages = [build_stage(job, k) for k in range(3)]
    with precision(job, "cpu"):
        _, outs = _chain(stages, ids)
        whole = build_model(job)(ids)
    assert [o.dtype for o in outs[:-1]] == [torch.float32, torch.float32]  # as stages take them
    gap = (loss_sum(outs[-1], targets) - loss_sum(whole, targets)).abs()
    assert gap < 1e-2 * loss_sum(whole, targets)


def test_writes_before_the_last_boundary_are_in_the_subspace_and_after_it_are_not(
    tmp_path: Path,
) -> None:
    job = _job(tmp_path, stages=3)
    sub = subspace_of(job)
    assert sub is not None
    whole = build_model(job)
    ids, _ = _batch(job)
    h = whole.layers["0"](ids)
    off = (h - sub.fixed(ids)) - sub.project(h - sub.fixed(ids))
    assert off.abs().max() < 1e-12  # the embedding writes E + span(U)
    last = build_stage(job, 2).indices[0]
    block = whole.layers[str(last)]
    y = block(h) - h  # a block of the last stage writes at full width
    assert (y - sub.project(y)).abs().max() > 1e-6


def test_every_process_builds_the_same_basis_and_a_seed_or_rank_changes_it(tmp_path: Path) -> None:
    a, b = subspace_of(_job(tmp_path)), subspace_of(_job(tmp_path))
    assert a is not None and b is not None
    assert torch.equal(a.basis, b.basis) and torch.equal(a.tokens, b.tokens)
    eye = a.basis.T @ a.basis
    assert torch.allclose(eye, torch.eye(RANK, dtype=eye.dtype), atol=1e-12)
    other = subspace_of(_job(tmp_path, boundary_rank=RANK + 1))
    assert other is not None and other.basis.shape[1] == RANK + 1
    # The basis and table are buffers outside every state: checkpoints and state transfer
    # carry the layers only.
    assert not any(k.startswith("subspace") for k in build_stage(_job(tmp_path), 1).state_dict())


def test_the_rank_is_part_of_the_fingerprint_and_absent_keeps_old_prints(tmp_path: Path) -> None:
    plain = make_job(tmp_path)
    zero = make_job(tmp_path, model={"boundary_rank": 0})
    assert fingerprint(plain) == fingerprint(zero)
    assert fingerprint(_job(tmp_path)) != fingerprint(_job(tmp_path, boundary_rank=RANK + 1))
    assert fingerprint(_job(tmp_path)) != fingerprint(make_job(tmp_path, model={"n_layers": 4}))


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"model": {"boundary_rank": 32}}, "below model.d_model"),
        ({"model": {"boundary_rank": 40}}, "below model.d_model"),
        ({"model": {"boundary_rank": -1}}, "model.boundary_rank"),
        ({"model": {"boundary_rank": 4}, "training": {"stages": 1}}, "two stages or more"),
    ],
)
def test_a_bad_rank_is_refused_by_name(tmp_path: Path, overrides: Any, says: str) -> None:
    with pytest.raises(ConfigError, match=r"model\.boundary_rank") as e:
        make_job(tmp_path, **overrides)
    assert says in str(e.value)


def test_a_stage_without_the_token_ids_says_so(tmp_path: Path) -> None:
    job = _job(tmp_path)
    c = torch.zeros(1, job.model.seq_len, RANK, dtype=torch.float64)
    with pytest.raises(ValueError, match="token ids"):
        build_stage(job, 1)(c)


def test_token_ids_travel_narrow(tmp_path: Path) -> None:
    ids = torch.tensor([[0, 255]])
    assert wire_tokens(ids, 256).dtype == torch.uint8
    assert wire_tokens(ids, 50_000).dtype == torch.int32


def test_the_table_std_scales_the_fixed_table_and_leaves_the_basis(tmp_path: Path) -> None:
    default, none, wide = (
        subspace_of(_job(tmp_path, **extra))
        for extra in ({}, {"boundary_table": 0.0}, {"boundary_table": 0.5})
    )
    assert default is not None and none is not None and wide is not None
    assert torch.equal(default.basis, none.basis) and torch.equal(default.basis, wide.basis)
    assert not none.tokens.any() and not none.positions.any()  # 0: no fixed table at all
    torch.testing.assert_close(wide.tokens, default.tokens * 5, rtol=1e-12, atol=0)
    assert abs(float(wide.tokens.std()) - 0.5) < 0.05


def test_the_table_std_is_part_of_the_fingerprint_only_when_set(tmp_path: Path) -> None:
    assert fingerprint(_job(tmp_path)) == fingerprint(_job(tmp_path, boundary_table=0.1))
    assert fingerprint(_job(tmp_path)) != fingerprint(_job(tmp_path, boundary_table=0.0))
    assert fingerprint(_job(tmp_path)) != fingerprint(_job(tmp_path, boundary_table=0.02))


@pytest.mark.parametrize(
    "model",
    [
        {"boundary_rank": 4, "boundary_table": -0.1},
        {"boundary_rank": 4, "boundary_table": float("inf")},
        {"boundary_rank": 4, "boundary_table": float("nan")},
        {"boundary_table": 0.0},  # a table without a subspace: no boundary to rebuild
    ],
)
def test_a_bad_table_std_is_refused_by_name(tmp_path: Path, model: Any) -> None:
    with pytest.raises(ConfigError, match=r"model\.boundary_table"):
        make_job(tmp_path, model=model)
