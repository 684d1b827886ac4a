"""bf16-mixed: the Linears' bfloat16 copies, their gradients added straight into the float32 sums
(`swarm.model.low_copies`), give bitwise what autocast's casts, each gradient widened to float32
and then added, gave: outputs, sums over microbatches, and gradients taken without summing."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
import torch
from torch import nn

from stage_server.replica.runtime import StageRuntime
from swarm.device.oom import OutOfDeviceMemory
from swarm.model.flat import flat_copy
from swarm.model.low_copies import LowCopies, castable
from swarm.model.transformer import build_model, loss_sum, precision
from swarm.ops import faults
from swarm.wire.crossing import Crossing
from tests.support.cuda_param import CPU_AND_CUDA
from tests.support.jobs import make_job

MIXED = {"precision": "bf16-mixed", "dtype": "float32"}
LLAMA = {"kind": "llama", "n_kv_heads": 1}


def _job(tmp_path: Path, kind: str) -> object:
    model = LLAMA if kind == "llama" else {}
    return make_job(tmp_path, model=model, training={**MIXED, "stages": 1})


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, 64, (4, 16), generator=gen), torch.randint(0, 64, (4, 16), generator=gen))
        for _ in range(n)
    ]


def _sums(
    model: nn.Module, job: object, low: LowCopies | None, steps: int = 2
) -> list[torch.Tensor]:
    """Each step: three microbatches' gradients summed into flat -0.0 `.grad`s (as a replica's
    sums), then an SGD move so the next step computes on changed weights."""
    params = list(model.parameters())
    sums: list[torch.Tensor] = []
    for _ in range(steps):
        for p, g in zip(params, flat_copy(params, fill=-0.0), strict=True):
            p.grad = g
        for x, y in _batches(3):
            with precision(job, "cpu"):  # type: ignore[arg-type]
                out = model(x) if low is None else low.call(model, (x,))
                loss = loss_sum(out, y)
            with low.into_grads() if low is not None else torch.enable_grad():
                loss.backward()
        sums += [p.grad.clone() for p in params if p.grad is not None]
        with torch.no_grad():
            for p in params:
                p.sub_(0.01 * p.grad)  # type: ignore[operator]
    return sums


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_sums_into_float32_are_bitwise_autocasts(tmp_path: Path, kind: str) -> None:
    job = _job(tmp_path, kind)
    old, new = build_model(job), build_model(job)  # type: ignore[arg-type]
    low = LowCopies()
    assert castable(new)  # the Linears' weights are cast: the path under test is taken
    expected, got = _sums(old, job, None), _sums(new, job, low)
    assert len(expected) == len(got)
    for a, b in zip(expected, got, strict=True):
        assert a.dtype == b.dtype == torch.float32
        assert torch.equal(a, b)


def test_a_gradient_taken_outside_into_grads_is_autocast_s_float32(tmp_path: Path) -> None:
    job = _job(tmp_path, "llama")
    model, low = build_model(job), LowCopies()  # type: ignore[arg-type]
    x, y = _batches(1)[0]
    params = list(model.parameters())
    with precision(job, "cpu"):  # type: ignore[arg-type]
        expected = torch.autograd.grad(loss_sum(model(x), y), params)
        got = torch.autograd.grad(loss_sum(low.call(model, (x,)), y), params)
    for a, b in zip(expected, got, strict=True):
        assert b.dtype == torch.float32 and torch.equal(a, b)
    assert all(p.grad is None for p in params)  # and nothing was added anywhere


def test_a_copy_is_made_once_per_version_of_its_weight() -> None:
    w, low = nn.Parameter(torch.randn(8, 8)), LowCopies()
    first = low.low(w)
    assert low.low(w) is first  # unchanged: the same copy
    with torch.no_grad():
        w.add_(1.0)
    second = low.low(w)
    assert second is not first and torch.equal(second, w.detach().to(torch.bfloat16))
    assert not torch.equal(first, second)  # the old copy, which a held graph saved, kept


def test_a_weight_a_non_linear_also_uses_is_not_cast() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.head = nn.Linear(8, 16, bias=False)
            self.head.weight = self.emb.weight  # tied: the embedding must see float32
            self.mid = nn.Linear(8, 8)

    assert castable(Tied()) == ("mid.weight", "mid.bias")


def _assert_same_sums(rt: StageRuntime, other: StageRuntime) -> None:
    """Both replicas' sums of step 0's microbatches 0 and 1 (4 samples each): bitwise equal."""
    got, expected = rt.prepare(0, [0, 1], 8), other.prepare(0, [0, 1], 8)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_a_replica_s_sums_are_bitwise_autocast_s(tmp_path: Path, device: str) -> None:
    """The stage server's path (`backprop_into` with the replica's copies) against autocast's
    casts, each gradient widened then added, over two microbatches: bitwise on the CPU and on
    CUDA (widening is exact; the add is float32 either way)."""
    job = make_job(tmp_path, training=MIXED)
    rt = StageRuntime(job, 1, device=device)
    assert rt.low is not None
    reference = StageRuntime(job, 1, device=device)  # the same seeded parameters
    reference.low = None  # autocast's casts, as before the copies
    gen = torch.Generator().manual_seed(0)
    for index in range(2):
        x, g = (torch.randn(4, 16, 32, generator=gen).to(device) for _ in range(2))
        rt.forward(0, index, Crossing(x))
        rt.backward(0, index, None, g)
        reference.forward(0, index, Crossing(x))
        reference.backward(0, index, None, g)
    _assert_same_sums(rt, reference)


def test_a_backward_failing_after_a_copy_s_add_withdraws_the_sums_and_replays_exactly(
    tmp_path: Path,
) -> None:
    """`SWARM_FAULTS` backward-oom raises once the first gradient landed in the sums: in a
    Block's backward that is a copy's (its last Linear's), added inside the cast's backward.
    The sums it reached are withdrawn with their receipts, and the replayed microbatches add up
    to bitwise what a run without the failure holds."""
    job = make_job(tmp_path, training=MIXED)
    rt, clean = StageRuntime(job, 1), StageRuntime(job, 1)
    assert rt.low is not None
    added: list[torch.Tensor] = []
    into_grads = rt.low.into_grads

    def watched(
        reaching: Callable[[torch.Tensor], None], landed: Callable[[torch.Tensor], None]
    ) -> AbstractContextManager[None]:  # which weight's add comes first
        def seen(w: torch.Tensor) -> None:
            added.append(w)
            reaching(w)

        return into_grads(seen, landed)

    rt.low.into_grads = watched  # type: ignore[method-assign,assignment]
    gen = torch.Generator().manual_seed(0)
    batches = [tuple(torch.randn(4, 16, 32, generator=gen) for _ in range(2)) for _ in range(2)]
    for index, (x, g) in enumerate(batches):
        clean.backward(0, index, Crossing(x), g)
    (x0, g0), (x1, g1) = batches
    rt.backward(0, 0, Crossing(x0), g0)
    added.clear()
    faults.arm("backward-oom@0")
    try:
        with pytest.raises(OutOfDeviceMemory, match="injected: SWARM_FAULTS backward-oom@0"):
            rt.backward(0, 1, Crossing(x1), g1)
    finally:
        faults.arm("")
    assert len(added) == 1  # the failing backward's one add: a copy's, inside its cast
    assert rt.receipts() == {}  # withdrawn whole, microbatch 0's receipt with them
    for index, (x, g) in enumerate(batches):  # the coordinator replays them
        rt.backward(0, index, Crossing(x), g)
    _assert_same_sums(rt, clean)


def test_weights_in_place_of_the_parameters_are_cast_and_summed_as_autocast_s(
    tmp_path: Path,
) -> None:
    """The reference's delayed update computes on a copy of the weights (`functional_call`):
    those are what the copies are made of, and their `.grad`s what the gradients add into."""
    job = _job(tmp_path, "llama")
    model, low = build_model(job), LowCopies()  # type: ignore[arg-type]
    sums = []
    for use_low in (False, True):
        weights = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
        for w, g in zip(
            weights.values(), flat_copy(list(weights.values()), fill=-0.0), strict=True
        ):
            w.grad = g
        for x, y in _batches(2):
            with precision(job, "cpu"):  # type: ignore[arg-type]
                if use_low:
                    out = low.call(model, (x,), weights)
                else:
                    out = torch.func.functional_call(model, weights, (x,))
            with low.into_grads():
                loss_sum(out, y).backward()
        sums.append([w.grad for w in weights.values()])
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(*sums, strict=True))


def test_a_delayed_update_s_copies_of_the_module_are_cast_and_summed_as_autocast_s(
    tmp_path: Path,
) -> None:
    """delayed_update: steps compute on copies of the module one update old (deep copies, which
    keep the Linears' hooks): three steps applied, sums and parameters bitwise autocast's."""
    job = make_job(tmp_path, training={**MIXED, "delayed_update": True})
    rt, reference = StageRuntime(job, 1), StageRuntime(job, 1)
    reference.low = None
    gen = torch.Generator().manual_seed(0)
    m = job.training.microbatches_per_step
    for step in range(3):
        for index in range(m):
            x, g = (torch.randn(4, 16, 32, generator=gen) for _ in range(2))
            for r in (rt, reference):
                r.forward(step, index, Crossing(x))
                r.backward(step, index, None, g)
        sums = [r.prepare(step, list(range(m)), 4 * m) for r in (rt, reference)]
        assert all(torch.equal(a, b) for a, b in zip(*sums, strict=True)), step
        for r, s in zip((rt, reference), sums, strict=True):
            r.set_prepared(step, s, 4 * m)
            assert r.apply(step) is False
    after = [r.module.state_dict() for r in (rt, reference)]
    assert all(torch.equal(after[0][k], after[1][k]) for k in after[0])
