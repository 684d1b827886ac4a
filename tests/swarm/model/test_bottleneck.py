"""The learned bottleneck boundary (`model.boundary_bottleneck`): r values per token cross every
cut, forward and backward; the halves belong to the stages at the cut and are ordinary
parameters (in the state, the layout and every build alike); the stages chained are the whole
model (`swarm local`'s), for both families; bad widths are refused by name; the HF export says
it cannot write one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from swarm.errors import ConfigError
from swarm.job.fingerprint import fingerprint
from swarm.model.bottleneck import Expand, Squeeze
from swarm.model.hf import write_hf
from swarm.model.transformer import (
    boundary_width,
    build_model,
    build_stage,
    loss_sum,
    plain_state,
    stage_layout,
)
from tests.support.jobs import make_job

WIDTH = 4  # d_model 32: 8x fewer values per token each way


def _job(tmp_path: Path, kind: str = "gpt", stages: int = 3, **model: Any) -> Any:
    shape: dict[str, Any] = {"kind": kind, "n_layers": 4, "boundary_bottleneck": WIDTH, **model}
    return make_job(tmp_path, model=shape, training={"stages": stages})


def _batch(job: Any) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    cfg = job.model
    ids = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len), generator=gen)
    return ids, torch.randint(0, cfg.vocab_size, (3, cfg.seq_len), generator=gen)


def _trained_a_little(job: Any) -> Any:
    """The whole model after one plain SGD step: the nonlinear halves (zero at init) now act."""
    whole = build_model(job)
    ids, targets = _batch(job)
    loss_sum(whole(ids), targets).backward()
    with torch.no_grad():
        for p in whole.parameters():
            assert p.grad is not None
            p -= 0.5 * p.grad
            p.grad = None
    return whole


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_r_values_cross_each_cut_both_ways_and_the_stages_are_the_whole_model(
    tmp_path: Path, kind: str
) -> None:
    job = _job(tmp_path, kind)
    whole = _trained_a_little(job)
    stages = [build_stage(job, k) for k in range(3)]
    for stage in stages:  # the trained parameters, each stage its own share of them
        stage.load_state_dict({n: whole.state_dict()[n] for n in stage.state_dict()}, strict=True)
    ids, targets = _batch(job)
    leaves, outs, x = [], [], ids
    for k, stage in enumerate(stages):  # as the swarm runs them: each input a leaf
        leaf = x if k == 0 else x.detach().requires_grad_(True)
        x = stage(leaf)
        leaves.append(leaf)
        outs.append(x)
    assert [tuple(o.shape) for o in outs[:-1]] == [(3, job.model.seq_len, WIDTH)] * 2
    assert boundary_width(job.model) == WIDTH
    loss_sum(outs[-1], targets).backward()
    for k in (1, 0):  # each stage hands the gradient of its input on: r values per token
        g = leaves[k + 1].grad
        assert g is not None and g.shape == (3, job.model.seq_len, WIDTH)
        outs[k].backward(g)
    loss_sum(whole(ids), targets).backward()
    theirs = dict(whole.named_parameters())
    for stage in stages:
        for name, p in stage.named_parameters():
            assert p.grad is not None and theirs[name].grad is not None, name
            torch.testing.assert_close(p.grad, theirs[name].grad, rtol=0, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(outs[-1], whole(ids), rtol=0, atol=1e-12)


def test_the_halves_sit_at_the_cuts_in_every_build_and_layout(tmp_path: Path) -> None:
    job = _job(tmp_path)
    stages = [build_stage(job, k) for k in range(3)]
    for k, stage in enumerate(stages):
        first, last = stage.layers[str(stage.indices[0])], stage.layers[str(stage.indices[-1])]
        assert isinstance(first._modules.get("expand"), Expand) == (k > 0)
        assert isinstance(last._modules.get("squeeze"), Squeeze) == (k < 2)
        # The layout a state is checked against names the same parameters, shapes and dtypes.
        layout = {n: (p.shape, p.dtype) for n, p in stage_layout(job, k).named_parameters()}
        assert layout == {n: (p.shape, p.dtype) for n, p in stage.named_parameters()}
    names = set(build_model(job).state_dict())
    assert names == {n for s in stages for n in s.state_dict()}  # the union is the whole model
    assert sum("squeeze" in n for n in names) and sum("expand" in n for n in names)


def test_every_process_builds_the_same_halves_an_identity_path_at_step_0(tmp_path: Path) -> None:
    a, b = build_stage(_job(tmp_path), 1), build_stage(_job(tmp_path), 1)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    # The sender's A and the receiver's B, built by different stages, are U^T and U: at step 0
    # the cut is the projection U U^T of the residual.
    sender, receiver = build_stage(_job(tmp_path), 0), build_stage(_job(tmp_path), 1)
    squeeze = sender.layers[str(sender.indices[-1])]._modules["squeeze"]
    expand = receiver.layers[str(receiver.indices[0])]._modules["expand"]
    assert isinstance(squeeze, Squeeze) and isinstance(expand, Expand)
    a_, b_ = squeeze.identity.weight, expand.identity.weight
    assert torch.equal(a_.T, b_)
    torch.testing.assert_close(a_ @ b_, torch.eye(WIDTH, dtype=a_.dtype), rtol=0, atol=1e-12)
    h = torch.randn(2, 5, 32, dtype=torch.float64)
    torch.testing.assert_close(expand(squeeze(h)), (h @ b_) @ b_.T, rtol=0, atol=1e-12)


def test_the_width_is_part_of_the_fingerprint_and_absent_keeps_old_prints(tmp_path: Path) -> None:
    plain = make_job(tmp_path)
    assert fingerprint(plain) == fingerprint(make_job(tmp_path, model={"boundary_bottleneck": 0}))
    assert fingerprint(_job(tmp_path)) != fingerprint(_job(tmp_path, boundary_bottleneck=WIDTH + 1))
    rank = make_job(tmp_path, model={"n_layers": 4, "boundary_rank": WIDTH}, training={"stages": 3})
    assert fingerprint(_job(tmp_path)) != fingerprint(rank)


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"model": {"boundary_bottleneck": 32}}, "below model.d_model"),
        ({"model": {"boundary_bottleneck": -1}}, "model.boundary_bottleneck"),
        ({"model": {"boundary_bottleneck": 4}, "training": {"stages": 1}}, "two stages or more"),
        ({"model": {"boundary_bottleneck": 4, "boundary_rank": 4}}, "one small boundary"),
    ],
)
def test_a_bad_width_is_refused_by_name(tmp_path: Path, overrides: Any, says: str) -> None:
    with pytest.raises(ConfigError, match=r"model\.boundary_bottleneck") as e:
        make_job(tmp_path, **overrides)
    assert says in str(e.value)


def test_the_hf_export_refuses_a_bottleneck_model_by_name(tmp_path: Path) -> None:
    job = _job(tmp_path)
    state, cfg = plain_state(job, build_model(job).state_dict())
    with pytest.raises(ConfigError, match=r"model\.boundary_bottleneck = 4.*not exported"):
        write_hf(tmp_path / "out", state, cfg, None)
    assert not (tmp_path / "out").exists()
