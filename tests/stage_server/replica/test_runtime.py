"""The stage runtime without networking: the step protocol's arithmetic is exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stage_server.averaging.flat import flatten
from stage_server.replica.runtime import StageRuntime
from swarm.errors import FailedPrecondition, InvalidArgument
from swarm.job.config import JobConfig
from swarm.model.data import make_data
from swarm.model.optim import clip_scale
from swarm.model.transformer import loss_sum
from swarm.rpc.state_streams import Update
from swarm.wire.crossing import Crossing
from tests.support.crossing import first_stage
from tests.support.equality import assert_states_within, local_state
from tests.support.jobs import make_job


def _run_step(
    runtimes: list[StageRuntime],
    job: JobConfig,
    step: int,
    order: list[int],
    recompute: bool = False,
    clipped: float = 0.0,
) -> float:
    data = make_data(job)
    loss_total, samples = 0.0, 0
    for index in order:
        inputs, targets = data.microbatch(step, index)
        boundary = [inputs]
        for rt in runtimes[:-1]:
            boundary.append(rt.forward(step, index, Crossing(boundary[-1])))
            if recompute:
                rt._cache.clear()  # as if another replica had done the forward
        loss, grad, _ = runtimes[-1].forward_backward(step, index, Crossing(boundary[-1]), targets)
        loss_total += loss
        samples += inputs.shape[0]
        for k in range(len(runtimes) - 2, -1, -1):
            grad, _ = runtimes[k].backward(
                step, index, Crossing(boundary[k]), grad, need_grad_inputs=k > 0
            )
    if clipped:  # two phases, as the coordinator commits: one coefficient for every stage
        for rt in runtimes:
            rt.set_prepared(step, rt.prepare(step, order, samples), samples)
        scale = clip_scale([rt.prepared_sq_norm(step) for rt in runtimes], clipped)
        for rt in runtimes:
            assert rt.apply(step, scale) is False
        return loss_total / samples
    for rt in runtimes:
        assert rt.commit(step, order, samples) is False
    return loss_total / samples


@pytest.mark.parametrize(
    ("recompute", "model"),
    [(False, "gpt"), (True, "gpt"), (True, "llama")],
)
def test_stages_equal_local_training(tmp_path: Path, recompute: bool, model: str) -> None:
    job = make_job(tmp_path, model={"kind": model, "n_kv_heads": 1})
    runtimes = [StageRuntime(job, k) for k in range(job.training.stages)]
    m = job.training.microbatches_per_step
    for step in range(job.training.steps):
        # reversed order: accumulation order must not matter beyond float reordering
        _run_step(runtimes, job, step, list(reversed(range(m))), recompute)
    reference = local_state(job)
    swarm: dict[str, torch.Tensor] = {}
    for rt in runtimes:
        swarm.update(rt.state_dict())
    assert_states_within(swarm, reference, tol=1e-12)
    assert not torch.equal(
        reference["layers.0.tok.weight"], StageRuntime(job, 0).state_dict()["layers.0.tok.weight"]
    )


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_a_schedule_and_global_norm_clipping_equal_local_training(
    tmp_path: Path, schedule: str
) -> None:
    recipe = {"schedule": schedule, "warmup_steps": 2, "min_lr": 1e-3}
    job = make_job(
        tmp_path,
        training={"steps": 6, "grad_clip": 0.3},
        optimizer={"kind": "adamw", "lr": 1e-2, **recipe},
    )
    runtimes = [StageRuntime(job, k) for k in range(job.training.stages)]
    m = job.training.microbatches_per_step
    for step in range(job.training.steps):
        _run_step(runtimes, job, step, list(range(m)), clipped=job.training.grad_clip)
    swarm: dict[str, torch.Tensor] = {}
    for rt in runtimes:
        swarm.update(rt.state_dict())
    reference = local_state(job)
    assert_states_within(swarm, reference, tol=1e-12)
    # The clipping and the schedule both changed the result (each could fail to be applied).
    unclipped = make_job(tmp_path, "unclipped", training={"steps": 6}, optimizer=recipe)
    constant = make_job(tmp_path, "constant", training={"steps": 6, "grad_clip": 0.3})
    for other in (unclipped, constant):
        far = max((reference[k] - v).abs().max().item() for k, v in local_state(other).items())
        assert far > 1e-4, far


def test_duplicate_backward_is_not_counted_twice(tmp_path: Path) -> None:
    job = make_job(tmp_path, training={"stages": 1})
    rt = StageRuntime(job, 0)
    x, y = make_data(job).microbatch(0, 0)
    _, _, first = rt.forward_backward(0, 0, Crossing(x), y)
    accum = [a.clone() for a in rt.sums[0].accum or []]
    _, _, again = rt.forward_backward(0, 0, Crossing(x), y)
    assert not first.duplicate and again.duplicate
    assert all(torch.equal(a, b) for a, b in zip(accum, rt.sums[0].accum or [], strict=True))
    assert rt.receipts() == {0: 4}


def test_a_duplicate_under_another_run_is_refused_and_the_sums_stay(tmp_path: Path) -> None:
    """A push's run is its receipt's (`StepSums.runs`): a second accumulation of the microbatch
    under the same run is a duplicate, as above; under another it is refused as it accumulates
    (a replay behind a member's push of the lessee's run: `StepSums.other_run`)."""
    job = make_job(tmp_path, training={"stages": 1})
    rt = StageRuntime(job, 0)
    x, y = make_data(job).microbatch(0, 0)
    _, _, first = rt.forward_backward(0, 0, Crossing(x), y, run=7)
    accum = [a.clone() for a in rt.sums[0].accum or []]
    _, _, again = rt.forward_backward(0, 0, Crossing(x), y, run=7)
    assert not first.duplicate and again.duplicate
    with pytest.raises(FailedPrecondition, match="held here under run 7, not run 9"):
        rt.forward_backward(0, 0, Crossing(x), y, run=9)
    rt.forward_backward(0, 0, Crossing(x), y, accumulate=False, run=9)  # an audit's: not refused
    assert all(torch.equal(a, b) for a, b in zip(accum, rt.sums[0].accum or [], strict=True))
    assert (rt.receipts(), rt.receipt_runs()) == ({0: 4}, {0: 7})


def test_an_accumulating_index_outside_the_step_is_refused_and_leaves_no_receipt(
    tmp_path: Path,
) -> None:
    # Any caller's index was taken: a receipt for microbatch -10**12 (or one the step has
    # not), which the coordinator took for a replica holding what it must not, and voided
    # all its honest work of the step. An audit's re-execution or an evaluation accumulates
    # nothing, whatever its index.
    job = make_job(tmp_path, training={"stages": 1})
    rt = StageRuntime(job, 0)
    x, y = make_data(job).microbatch(0, 0)
    steps = job.training.microbatches_per_step
    for index in (-1, -(10**12), steps):
        with pytest.raises(InvalidArgument, match=f"microbatch {index} of step 0"):
            rt.forward_backward(0, index, Crossing(x), y)
    assert rt.receipts() == {}
    rt.forward_backward(0, steps + 3, Crossing(x), y, accumulate=False)  # no receipt to give
    rt.forward_backward(0, steps - 1, Crossing(x), y)
    assert rt.receipts() == {steps - 1: 4}


def test_commit_needs_exactly_the_named_receipts(tmp_path: Path) -> None:
    job = make_job(tmp_path, training={"stages": 1})
    rt = StageRuntime(job, 0)
    x, y = make_data(job).microbatch(0, 0)
    rt.forward_backward(0, 0, Crossing(x), y)
    with pytest.raises(FailedPrecondition, match=r"missing for microbatches \[1\]"):
        rt.commit(0, [0, 1], 8)
    with pytest.raises(FailedPrecondition, match=r"unexpected \[0\]"):
        rt.commit(0, [], 8)
    assert rt.commit(0, [0], 4) is False and rt.step == 1
    assert rt.commit(0, [0], 4) is True and rt.step == 1  # a retried commit changes nothing
    with pytest.raises(FailedPrecondition, match="stale"):
        rt.forward_backward(0, 1, Crossing(x), y)
    with pytest.raises(FailedPrecondition, match="not started"):
        rt.commit(5, [], 4)


def test_a_late_backward_after_prepare_does_not_reach_the_update(tmp_path: Path) -> None:
    # Microbatch 1 arrives after PREPARE checked the receipts (a straggler's duplicate the ledger
    # counted elsewhere): the applied update is microbatch 0's alone.
    job = make_job(tmp_path, training={"stages": 1})
    data = make_data(job)
    late, clean = StageRuntime(job, 0), StageRuntime(job, 0)
    for rt in (late, clean):
        rt.forward_backward(0, 0, *first_stage(data.microbatch(0, 0)))
    sums = late.prepare(0, [0], 4)
    late.forward_backward(0, 1, *first_stage(data.microbatch(0, 1)))
    late.set_prepared(0, sums, 4)
    assert late.apply(0) is False
    assert clean.commit(0, [0], 4) is False
    for name, value in clean.state_dict().items():
        assert torch.equal(late.state_dict()[name], value), name


def test_prepare_lends_the_sums_and_a_late_backward_adds_into_a_copy(tmp_path: Path) -> None:
    """A commit holds no copy of the step's sums: PREPARE lends them (one flat tensor, which
    `flatten` views without copying), a Backward after it adds into a copy so the prepared sums
    stay as they were, and APPLY takes the mean in place, into `.grad`."""
    job = make_job(tmp_path, training={"stages": 1})
    data = make_data(job)
    rt = StageRuntime(job, 0)
    rt.forward_backward(0, 0, *first_stage(data.microbatch(0, 0)))
    accum = list(rt.sums[0].accum or [])
    sums = rt.prepare(0, [0], 4)
    assert [s.data_ptr() for s in sums] == [a.data_ptr() for a in accum]  # lent, not copied
    flat = flatten(sums)
    assert flat.numel() == rt.num_parameters() and flat.data_ptr() == sums[0].data_ptr()
    before = flat.clone()
    rt.forward_backward(0, 1, *first_stage(data.microbatch(0, 1)))  # a straggler after PREPARE
    assert torch.equal(flat, before)  # the prepared sums are untouched
    assert (rt.sums[0].accum or [])[0].data_ptr() != sums[0].data_ptr()  # it went to a copy
    seen: list[int] = []
    step = rt.optimizer.step

    def stepping(*args: object, **kwargs: object) -> object:
        seen.extend(p.grad.data_ptr() for p in rt.params if p.grad is not None)
        return step(*args, **kwargs)  # type: ignore[call-overload]

    rt.optimizer.step = stepping  # type: ignore[method-assign,assignment]
    rt.set_prepared(0, sums, 4)
    assert rt.apply(0) is False
    assert seen == [s.data_ptr() for s in sums]  # the optimizer read the prepared memory
    assert 0 not in rt.sums  # and the step's sums were let go


def _averaged_in_place_half_way(rt: StageRuntime, sums: list[torch.Tensor], tmp_path: Path) -> None:
    """What a round averaging the lent sums in place leaves when it fails half way: the first
    half kept by the step's spill, then overwritten with (here) nonsense."""
    spill = rt.sums.spill(0, tmp_path / "spill")
    flat = flatten(sums)
    assert spill is not None and spill.flat.data_ptr() == flat.data_ptr()
    half = slice(0, flat.numel() // 2)
    spill.keep(half)
    flat[half] = 7.0


def _assert_same_states(a: StageRuntime, b: StageRuntime) -> None:
    for name, value in a.state_dict().items():
        assert torch.equal(b.state_dict()[name], value), name


def test_a_retried_prepare_gets_back_the_sums_a_round_overwrote_in_place(tmp_path: Path) -> None:
    """A PREPARE's round sums the pool's gradient over the lent sums in place: a retry of it
    (a member died mid-round) gets the sums as they were, and an earlier round's preparation
    of the step no longer counts (its sum was over the same memory)."""
    job = make_job(tmp_path, training={"stages": 1})
    data = make_data(job)
    rt, clean = StageRuntime(job, 0), StageRuntime(job, 0)
    for r in (rt, clean):
        for index in (0, 1):
            r.forward_backward(0, index, *first_stage(data.microbatch(0, index)))
    sums = rt.prepare(0, [0, 1], 8)
    before = flatten(sums).clone()
    _averaged_in_place_half_way(rt, sums, tmp_path)
    again = rt.prepare(0, [0, 1], 8)  # the retry, among the survivors
    assert torch.equal(flatten(again), before)
    rt.set_prepared(0, again, 8)  # that round completed (a pool of one sums nothing) ...
    _averaged_in_place_half_way(rt, rt.prepare(0, [0, 1], 8), tmp_path)  # ... then one more
    with pytest.raises(FailedPrecondition, match="step 0 was not prepared"):
        rt.apply(0)  # not the sums of a round that went nowhere
    rt.set_prepared(0, rt.prepare(0, [0, 1], 8), 8)
    assert rt.apply(0) is False and clean.commit(0, [0, 1], 8) is False
    _assert_same_states(rt, clean)


def test_a_straggler_after_an_in_place_round_adds_into_the_sums_as_they_were(
    tmp_path: Path,
) -> None:
    job = make_job(tmp_path, training={"stages": 1})
    data = make_data(job)
    rt, clean = StageRuntime(job, 0), StageRuntime(job, 0)
    for r in (rt, clean):
        r.forward_backward(0, 0, *first_stage(data.microbatch(0, 0)))
    _averaged_in_place_half_way(rt, rt.prepare(0, [0], 4), tmp_path)
    for r in (rt, clean):  # microbatch 1 reaches rt mid-round: into a copy of its sums
        r.forward_backward(0, 1, *first_stage(data.microbatch(0, 1)))
    rt.set_prepared(0, rt.prepare(0, [0, 1], 8), 8)  # the step is prepared anew, with both
    assert rt.apply(0) is False and clean.commit(0, [0, 1], 8) is False
    _assert_same_states(rt, clean)


def test_microbatches_add_into_the_sums_in_place_with_the_same_bits(tmp_path: Path) -> None:
    """Autograd adds each microbatch's gradients straight into the step's sums (no whole
    gradient beside them): the first's are their own bits (the sums start at -0.0), the
    next the same bits as `autograd.grad` then `add_`, for the parameters and the input's
    gradient."""
    job = make_job(tmp_path, training={"stages": 2})
    data = make_data(job)
    rt = StageRuntime(job, 1)
    x = torch.randn(4, job.model.seq_len, job.model.d_model, dtype=rt.dtype)
    y = data.microbatch(0, 0)[1]
    rt.forward_backward(0, 0, Crossing(x), y)
    accum = rt.sums[0].accum or []
    check = StageRuntime(job, 1)
    first = torch.autograd.grad(loss_sum(check.module(x), y), check.params)
    bits = [a.view(torch.int64) for a in accum]
    assert all(torch.equal(b, f.view(torch.int64)) for b, f in zip(bits, first, strict=True))
    expected = [a.clone() for a in accum]
    where = [a.data_ptr() for a in accum]
    x2 = torch.randn(4, job.model.seq_len, job.model.d_model, dtype=rt.dtype)
    _, grad_x, _ = rt.forward_backward(0, 1, Crossing(x2), y)
    _, grad_ref, _ = check.forward_backward(0, 1, Crossing(x2), y, accumulate=False)
    reference = check.sums[0].accum  # accumulate=False kept none: compute them as before
    assert reference is None
    leaf = x2.detach().requires_grad_(True)
    grads = torch.autograd.grad(loss_sum(check.module(leaf), y), check.params)
    for e, g in zip(expected, grads, strict=True):
        e.add_(g)
    assert [a.data_ptr() for a in rt.sums[0].accum or []] == where  # in place
    assert all(torch.equal(a, e) for a, e in zip(rt.sums[0].accum or [], expected, strict=True))
    assert grad_x is not None and grad_ref is not None and torch.equal(grad_x, grad_ref)
    assert all(p.grad is None for p in rt.params)  # nothing left on the parameters


def test_accumulate_false_returns_gradients_without_a_receipt(tmp_path: Path) -> None:
    job = make_job(tmp_path, training={"stages": 2})
    rt = StageRuntime(job, 1)
    x = torch.randn(4, 16, 32, dtype=torch.float64)
    y = torch.randint(0, 64, (4, 16))
    _, grad, receipt = rt.forward_backward(0, 0, Crossing(x), y, accumulate=False)
    assert grad is not None and grad.shape == x.shape and rt.receipts() == {}
    assert not receipt.duplicate


@pytest.mark.parametrize(
    ("stage", "inputs", "message"),
    [
        (0, torch.zeros(4, 16), "int64 token ids"),
        (0, torch.full((4, 16), 64, dtype=torch.int64), r"token ids must lie in \[0, 64\)"),
        (0, torch.zeros(4, 17, dtype=torch.int64), "seq in 1..16"),
        (1, torch.zeros(4, 16, 31, dtype=torch.float64), "float64 \\[batch, seq, 32\\]"),
        (1, torch.zeros(4, 16, 32, dtype=torch.float32), "got torch.float32"),
        (1, torch.zeros(0, 16, 32, dtype=torch.float64), "batch must be >= 1"),
        (0, torch.zeros(5, 16, dtype=torch.int64), r"training.microbatch_size = 4"),
        (1, torch.zeros(5, 16, 32, dtype=torch.float64), r"training.microbatch_size = 4"),
    ],
)
def test_bad_inputs_are_refused(
    tmp_path: Path, stage: int, inputs: torch.Tensor, message: str
) -> None:
    rt = StageRuntime(make_job(tmp_path), stage)
    with pytest.raises(InvalidArgument, match=message):
        rt.forward(0, 0, Crossing(inputs))


def test_bad_grad_and_targets_are_refused(tmp_path: Path) -> None:
    job = make_job(tmp_path)
    rt = StageRuntime(job, 1)
    x = torch.zeros(4, 16, 32, dtype=torch.float64)
    rt.forward(0, 0, Crossing(x))
    with pytest.raises(InvalidArgument, match="grad_outputs must be"):
        rt.backward(0, 0, Crossing(x), torch.zeros(4, 16, 31, dtype=torch.float64))
    last = StageRuntime(job, 3)
    with pytest.raises(InvalidArgument, match="targets must be int64"):
        last.forward_backward(0, 0, Crossing(x), torch.zeros(4, 15, dtype=torch.int64))
    with pytest.raises(InvalidArgument, match="for the last stage"):
        rt.forward_backward(0, 0, Crossing(x), torch.zeros(4, 16, dtype=torch.int64))


def test_activation_cache_is_bounded(tmp_path: Path) -> None:
    job = make_job(tmp_path, runtime={"activation_cache": 2})
    rt = StageRuntime(job, 1)
    for index in range(5):
        rt.forward(0, index, Crossing(torch.randn(4, 16, 32, dtype=torch.float64)))
    assert sorted(rt._cache) == [(0, 3, ""), (0, 4, "")]


@pytest.mark.parametrize("grad_clip", [0.0, 0.05])
def test_a_copy_following_the_updates_of_its_source_is_bitwise_identical(
    tmp_path: Path, grad_clip: float
) -> None:
    job = make_job(tmp_path, training={"stages": 1, "steps": 5, "grad_clip": grad_clip})
    m = job.training.microbatches_per_step
    source = StageRuntime(job, 0)
    _run_step([source], job, 0, list(range(m)), clipped=grad_clip)
    # The copy downloads the state at step 1 while the pool trains on.
    source.updates.follow("copy", source.step)
    copy = StageRuntime(job, 0)
    copy.follow.load(source.step, source.export_state(include_optimizer=True))
    for step in (1, 2, 3):
        _run_step([source], job, step, list(range(m)), clipped=grad_clip)
    updates = source.updates.since("copy", copy.step)
    assert all((u.scale < 1.0) == (grad_clip > 0) for u in updates)  # the clipping bit
    for u in updates:
        assert copy.follow.apply(u)
    assert copy.step == source.step == 4
    for name, tensor in source.export_state(include_optimizer=True).items():
        assert torch.equal(tensor, copy.export_state(include_optimizer=True)[name]), name
    # A member now (its first PREPARE): it applies its own pool's updates, never its source's.
    _run_step([source, copy][1:], job, 4, list(range(m)), clipped=grad_clip)
    assert not copy.following
    assert copy.follow.apply(Update(5, [torch.zeros(1)], 1)) is False and copy.step == 5


def test_a_follower_refuses_an_update_it_skipped(tmp_path: Path) -> None:
    job = make_job(tmp_path, training={"stages": 1})
    source = StageRuntime(job, 0)
    copy = StageRuntime(job, 0)
    copy.follow.load(0, source.export_state(include_optimizer=True))
    with pytest.raises(FailedPrecondition, match="update of step 2 at 0"):
        copy.follow.apply(Update(2, [torch.zeros(1)], 16))


def test_bf16_mixed_computes_in_bf16_and_keeps_float32_weights_and_sums(tmp_path: Path) -> None:
    training = {"dtype": "float32", "stages": 1}
    bf16 = training | {"precision": "bf16-mixed"}
    mixed = StageRuntime(make_job(tmp_path, "m", training=bf16), 0)
    full = StageRuntime(make_job(tmp_path, "f", training=training), 0)
    inputs, targets = make_data(mixed.job).microbatch(0, 0)
    loss, _, _ = mixed.forward_backward(0, 0, Crossing(inputs), targets)
    loss32, _, _ = full.forward_backward(0, 0, Crossing(inputs), targets)
    assert loss != loss32 and abs(loss - loss32) < 1e-2 * loss32  # bf16 matmuls: close, not equal
    assert mixed.sums[0].accum is not None and full.sums[0].accum is not None
    assert {t.dtype for t in [*mixed.params, *mixed.sums[0].accum]} == {torch.float32}
    assert mixed.commit(0, [0], 4) is False  # the update in float32, optimizer state too
    state = mixed.optimizer.state[mixed.params[0]]
    assert state["exp_avg"].dtype == torch.float32
