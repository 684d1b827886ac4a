"""The update rule every replica and the reference share: the learning rate of each step and the
global-norm clipping coefficient are pure functions, so they agree everywhere."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from swarm.errors import NonFiniteGradient
from swarm.job.config import OptimizerConfig
from swarm.model.flat import flat_view
from swarm.model.low_copies import LowCopies
from swarm.model.optim import (
    NORM_PIECE,
    NORM_ROWS,
    build_optimizer,
    clip_scale,
    grad_sq_norm,
    lr_at,
    scale_grads,
)


def _opt(**kw: object) -> OptimizerConfig:
    return OptimizerConfig(**{"kind": "adamw", "lr": 1.0, **kw})  # type: ignore[arg-type]


def test_warmup_rises_linearly_from_the_first_step() -> None:
    cfg = _opt(warmup_steps=4, schedule="cosine", min_lr=0.1)
    assert [lr_at(cfg, s, 10) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(cfg, 4, 10) == 1.0  # the decay starts at lr


@pytest.mark.parametrize(
    ("schedule", "middle"), [("constant", 1.0), ("linear", 0.55), ("cosine", 0.55)]
)
def test_schedules_end_at_min_lr_on_the_last_step(schedule: str, middle: float) -> None:
    cfg = _opt(schedule=schedule, min_lr=0.1)
    steps = 11  # steps 0..10: the middle is step 5
    assert lr_at(cfg, 0, steps) == 1.0
    assert lr_at(cfg, 5, steps) == pytest.approx(middle)
    assert lr_at(cfg, 10, steps) == pytest.approx(1.0 if schedule == "constant" else 0.1)
    assert lr_at(cfg, 50, steps) == lr_at(cfg, 10, steps)  # past the end: held, not negative
    rates = [lr_at(cfg, s, steps) for s in range(steps)]
    assert rates == sorted(rates, reverse=True)


def test_cosine_is_half_way_down_at_half_time() -> None:
    cfg = _opt(schedule="cosine", warmup_steps=2, min_lr=0.0)
    # after warm-up, steps 2..12 decay: step 7 is half way
    assert lr_at(cfg, 7, 13) == pytest.approx(0.5)
    assert lr_at(cfg, 3, 13) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.1)))


def test_the_clipping_coefficient_scales_the_whole_norm_down_to_the_limit() -> None:
    assert clip_scale([9.0, 16.0], 0.0) == 1.0  # off
    assert clip_scale([9.0, 16.0], 5.0) == pytest.approx(1.0, abs=1e-6)
    assert clip_scale([9.0, 16.0], 6.0) == 1.0  # smaller than the limit: untouched
    assert clip_scale([9.0, 16.0], 1.0) == 1 / (5 + 1e-6)
    assert clip_scale([0.0, 0.0], 1.0) == 1.0  # a zero gradient stays zero, not NaN


def test_a_stages_squared_norm_is_taken_in_float64() -> None:
    grads = [torch.full((3,), 1e20, dtype=torch.float32), torch.tensor([3.0, 4.0])]
    assert grad_sq_norm(grads) == pytest.approx(3e40, rel=1e-6)  # float32 would overflow: inf
    assert grad_sq_norm([torch.tensor([3.0, 4.0])]) == 25.0
    assert grad_sq_norm([]) == 0.0


def test_min_lr_above_lr_is_refused() -> None:
    with pytest.raises(ValueError, match=r"optimizer\.min_lr"):
        _opt(min_lr=2.0)
    with pytest.raises(ValueError, match=r"optimizer\.schedule"):
        _opt(schedule="step")
    with pytest.raises(ValueError, match=r"optimizer\.warmup_steps"):
        _opt(warmup_steps=-1)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("max_norm", [0.0, 1.0])
def test_a_non_finite_norm_has_no_clipping_coefficient(bad: float, max_norm: float) -> None:
    # Before: NaN gave 1.0 (the NaN gradient applied as it was) and inf gave 0.0 (refused by
    # every replica's APPLY: the step stalled). No coefficient makes either finite, clipping
    # on or off: the reference fails as the swarm's coordinator does.
    with pytest.raises(NonFiniteGradient, match=r"stage 1 .*not finite"):
        clip_scale([4.0, bad], max_norm)


def _pieces_summed(values: torch.Tensor) -> float:
    """The definition, written out: each NORM_PIECE elements' float64 squares summed, then
    those partial sums summed (in one tensor sum)."""
    parts = [p.double().square().sum() for p in values.reshape(-1).split(NORM_PIECE)]
    return float(torch.stack(parts).sum())


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Bits are compared: a sum this long is split among torch's threads, whose number moves
    its rounding (a piece's sum came out 1 ulp apart with 1, 2 and 3 threads), and a test before
    may have set any. Every process of a job sums in the threads it has, so the norm agrees
    across processes within rounding, as the float64 bound asks; within one, to the bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
def test_the_norm_sums_pieces_of_the_gradient_laid_end_to_end() -> None:
    gen = torch.Generator().manual_seed(0)
    small = torch.randn(NORM_PIECE, generator=gen)
    large = torch.randn(2 * NORM_PIECE + 7, generator=gen)
    # up to a piece: the same bits as the one sum it always was
    assert grad_sq_norm([small]) == float(small.double().square().sum())
    assert grad_sq_norm([large]) == _pieces_summed(large)
    assert grad_sq_norm([large]) == pytest.approx(float(large.double().square().sum()), rel=1e-12)
    for bad in (float("inf"), float("nan")):  # in a later piece: still seen
        broken = large.clone()
        broken[-1] = bad
        assert not math.isfinite(grad_sq_norm([broken]))
    assert grad_sq_norm([torch.tensor(2.0), torch.empty(0)]) == 4.0  # 0-dim and empty
    as_is = large.double()
    kept = as_is.clone()
    assert grad_sq_norm([as_is]) == _pieces_summed(kept)
    assert torch.equal(as_is, kept)  # a float64 gradient is read, never squared in place
    assert grad_sq_norm([]) == 0.0 and grad_sq_norm([torch.empty(0)]) == 0.0


@pytest.mark.usefixtures("one_thread")
def test_the_norm_is_the_same_bits_however_the_gradient_is_cut_and_held() -> None:
    """A replica's sums are views of one flat tensor; the reference's gradients too, or (with
    delayed updates) tensors of their own: the same values give the same norm either way."""
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(NORM_ROWS * NORM_PIECE + 3 * NORM_PIECE + 11, generator=gen)
    sizes = [5, NORM_PIECE - 3, 2 * NORM_PIECE + 1, values.numel() - 3 * NORM_PIECE - 3]
    views = list(values.split(sizes))  # laid end to end: one view, no copy
    apart = [v.clone() for v in views]  # each its own: copied end to end once
    assert flat_view(views) is not None and flat_view(apart) is None
    assert grad_sq_norm(views) == grad_sq_norm(apart) == _pieces_summed(values)


def test_the_mean_and_the_clipping_are_a_kernel_each_over_flat_gradients() -> None:
    gen = torch.Generator().manual_seed(4)
    flat = torch.randn(1000, dtype=torch.float64, generator=gen)
    grads = list(flat.split([10, 300, 690]))
    apart = [g.clone() for g in grads]
    with _Calls() as mode:
        scale_grads(grads, 7.0, 0.5)
    assert mode.calls.count("div_") == 1 and mode.calls.count("mul_") == 1
    scale_grads(apart, 7.0, 0.5)  # one a tensor, the same two roundings of each element
    assert all(torch.equal(a, b) for a, b in zip(apart, grads, strict=True))
    assert torch.equal(flat[:10], apart[0])


class _Calls(torch.overrides.TorchFunctionMode):
    """The names of the torch functions called inside."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_a_large_stages_norm_is_a_few_kernels_not_a_few_a_piece() -> None:
    """Before: ~5 calls per 1M-element piece (~1,300 for a 243M-parameter stage on a GPU, each
    a kernel launch); now a few per NORM_ROWS pieces."""
    flat = torch.zeros(40 * NORM_PIECE)
    grads = list(flat.split([NORM_PIECE // 2] * 80))  # 80 tensors, 40 pieces, end to end
    with _Calls() as mode:
        grad_sq_norm(grads)
    launching = ("to", "double", "square_", "square", "sum", "cat", "add")
    kernels = [c for c in mode.calls if c in launching]
    assert len(kernels) <= 12, kernels  # 3 chunks of 16 pieces: 3 each, and the total's 2


class _Reads(torch.overrides.TorchFunctionMode):
    """Counts a tensor's values read back to Python (`float(t)`, `t.item()`): on a GPU each one
    waits for the device."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in (torch.Tensor.__float__, torch.Tensor.item):
            self.reads += 1
        return func(*args, **(kwargs or {}))


def test_a_stages_norm_reads_the_device_once() -> None:
    """The pieces' squares are summed where the gradient lies; only the total is read back
    (before: a read, so on a GPU a synchronization, per 1M-element piece)."""
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(3 * NORM_PIECE + 5, generator=gen), torch.randn(7, generator=gen)]
    with _Reads() as mode:
        total = grad_sq_norm(grads)
    assert mode.reads == 1
    assert total == _pieces_summed(torch.cat(grads))


def test_on_a_cpu_adamw_takes_the_per_tensor_path() -> None:
    optimizer = build_optimizer([torch.nn.Parameter(torch.zeros(3))], _opt(lr=1e-3))
    assert optimizer.defaults["foreach"] is False
    assert not optimizer.defaults["fused"]


def test_fused_adamw_moves_the_versions_of_the_weights_it_writes() -> None:
    # Issue 63: the fused kernel (a CUDA stage's AdamW; on a CPU the same kernel, run here as
    # its stand-in) writes the weights through their pointers and autograd's versions stayed:
    # the bf16 copies and casts keyed on them kept the weights of before the update.
    cfg = _opt(lr=1e-2, weight_decay=0.1)
    fused = [torch.nn.Parameter(torch.randn(8, 8)) for _ in range(2)]
    plain = [torch.nn.Parameter(p.detach().clone()) for p in fused]
    on_fused, on_plain = build_optimizer(fused, cfg, fused=True), build_optimizer(plain, cfg)
    assert on_fused.defaults["fused"] is True and not on_plain.defaults["fused"]
    low = LowCopies()
    before = [low.low(p).clone() for p in fused]
    versions = [p._version for p in fused]
    for params, optimizer in ((fused, on_fused), (plain, on_plain)):
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()
    assert all(p._version > v for p, v in zip(fused, versions, strict=True))
    for p, old, q in zip(fused, before, plain, strict=True):
        assert not torch.equal(low.low(p), old)  # copied anew from the updated weight
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)  # the per-tensor path's update


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_adamw_on_cuda_agrees_with_the_cpu_reference() -> None:
    """Fused on CUDA (one kernel a step), within float32 rounding of the CPU's per-tensor path
    after 20 steps; the stage's squared norm on the GPU equals the CPU's."""
    gen = torch.Generator().manual_seed(2)
    shapes = [(256, 256), (256,), (1000, 64)]
    start = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    grads = [[torch.randn(s, generator=gen) * 1e-3 for s in shapes] for _ in range(20)]
    cfg = _opt(lr=1e-3, weight_decay=0.1)
    cpu = [torch.nn.Parameter(t.clone()) for t in start]
    gpu = [torch.nn.Parameter(t.clone().cuda()) for t in start]
    on_cpu, on_gpu = build_optimizer(cpu, cfg), build_optimizer(gpu, cfg)
    assert on_gpu.defaults["fused"] is True
    for step in grads:
        for params, optimizer in ((cpu, on_cpu), (gpu, on_gpu)):
            for p, g in zip(params, step, strict=True):
                p.grad = g.to(p.device)
            optimizer.step()
    for a, b in zip(gpu, cpu, strict=True):
        ours, reference = a.detach().cpu().double(), b.detach().double()
        err = float((ours - reference).norm() / reference.norm())
        assert err < 1e-6, err
    cuda_grads = [g.cuda() for g in grads[0]]
    assert grad_sq_norm(cuda_grads) == pytest.approx(grad_sq_norm(grads[0]), rel=1e-12)
