"""bf16-mixed: a stage's weights are cast once while they stay as they are, not once per
microbatch (`swarm.model.cast_once`), with bitwise the results of casting per microbatch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stage_server.replica.runtime import StageRuntime
from swarm.job.config import JobConfig
from swarm.model.optim import build_optimizer
from swarm.model.reference import train_local
from swarm.model.transformer import precision
from swarm.wire.crossing import Crossing
from tests.support.cuda_param import CPU_AND_CUDA
from tests.support.jobs import make_job

MIXED = {"precision": "bf16-mixed", "dtype": "float32"}


def _casts(rt: StageRuntime, step: int, index: int, x: torch.Tensor) -> dict[tuple, torch.Tensor]:
    """The bfloat16 weight casts microbatch `(step, index)`'s kept graph saved, by shape (the
    stage's matmul weights, each shape its own); held, so their memory is not reused."""
    weights = {tuple(p.shape) for p in rt.module.parameters() if p.dim() == 2}
    rt.forward(step, index, Crossing(x))
    kept = rt._cache._entries[(step, index, "")][0][1]
    seen: dict[tuple, torch.Tensor] = {}
    todo, done = [kept.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in done:
            continue
        done.add(node)
        for name in dir(node):
            if name.startswith("_saved_"):
                t = getattr(node, name)
                if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16:
                    shape = tuple(t.shape)
                    if shape in weights or shape[::-1] in weights:
                        seen.setdefault(shape, t)
        todo += [n for n, _ in node.next_functions]
    assert seen, "no bfloat16 weight was saved: not bf16-mixed?"
    return seen


def _apply(rt: StageRuntime, step: int, indices: list[int], samples: int) -> None:
    rt.set_prepared(step, rt.prepare(step, indices, samples), samples)
    assert rt.apply(step) is False


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_a_step_casts_each_weight_once_and_an_update_casts_anew(
    tmp_path: Path, device: str
) -> None:
    _casts_once_and_anew(StageRuntime(make_job(tmp_path, training=MIXED), 1, device=device))


def test_under_fused_adamw_an_update_casts_anew_too(tmp_path: Path) -> None:
    # Issue 63: a CUDA stage's AdamW is fused, whose kernel writes the weights without moving
    # their versions: the casts keyed on those were reused after the update, so the stage kept
    # computing on the weights of before. On a CPU, torch's fused AdamW is the same kernel.
    rt = StageRuntime(make_job(tmp_path, training=MIXED), 1)
    rt.optimizer = build_optimizer(rt.params, rt.job.optimizer, fused=True)  # as on CUDA
    assert rt.optimizer.defaults["fused"] is True
    _casts_once_and_anew(rt)


def _casts_once_and_anew(rt: StageRuntime) -> None:
    device = rt.device
    x = torch.randn(4, 16, 32, device=device)
    first, second = _casts(rt, 0, 0, x), _casts(rt, 0, 1, x)
    assert first.keys() == second.keys()
    for k in first:  # the second microbatch reused the first one's casts
        assert first[k].untyped_storage().data_ptr() == second[k].untyped_storage().data_ptr()
    for index in (0, 1):
        rt.backward(0, index, None, torch.randn(4, 16, 32, device=device))
    _apply(rt, 0, [0, 1], 8)  # the weights changed in place: their casts are stale
    after = _casts(rt, 1, 0, x)
    assert after.keys() == first.keys()
    for k in first:  # cast anew from the updated weights (the old casts are still held)
        assert after[k].untyped_storage().data_ptr() != first[k].untyped_storage().data_ptr()
        assert not torch.equal(after[k], first[k])


def test_casting_once_gives_the_bits_casting_per_microbatch_gives(tmp_path: Path) -> None:
    job = make_job(tmp_path, training=MIXED)
    rt = StageRuntime(job, 1)
    plain = StageRuntime(job, 1)  # the same parameters, computed as before: a region each
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, 16, 32, generator=gen) for _ in range(3)]
    grads = [torch.randn(4, 16, 32, generator=gen) for _ in range(3)]
    for step in range(2):
        for i, (x, g) in enumerate(zip(xs, grads, strict=True)):
            out = rt.forward(step, i, Crossing(x))
            leaf = x.detach().requires_grad_(True)
            with torch.enable_grad(), precision(job, plain.device):
                expected = plain.module(leaf)
            assert torch.equal(out, expected.detach())
            rt.backward(step, i, None, g)
            plain.backward(step, i, Crossing(x), g)  # recomputed in its own region: cast afresh
        sums, expected_sums = rt.prepare(step, [0, 1, 2], 12), plain.prepare(step, [0, 1, 2], 12)
        assert all(torch.equal(a, b) for a, b in zip(sums, expected_sums, strict=True))
        _apply(rt, step, [0, 1, 2], 12)
        _apply(plain, step, [0, 1, 2], 12)


def _reference(job: JobConfig) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in train_local(job, steps=2).state_dict().items()}


def test_the_reference_on_the_same_thread_never_sees_a_stage_call_s_casts(tmp_path: Path) -> None:
    job = make_job(tmp_path, training=MIXED)
    alone = _reference(job)
    rt = StageRuntime(job, 1)
    rt.forward(0, 0, Crossing(torch.randn(4, 16, 32)))  # casts kept on this thread
    beside = _reference(job)
    rt.forward(0, 1, Crossing(torch.randn(4, 16, 32)))
    assert all(torch.equal(alone[k], beside[k]) for k in alone)
