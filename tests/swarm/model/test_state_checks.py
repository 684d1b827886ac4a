"""What a receiver of a stage's state expects (`StateChecks`), from the stage's layout alone: it
takes every state a replica exports (parameters, an optimizer's state after a step, with
delayed_update the parameters before the last update) and its updates, and refuses the rest."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarm.errors import InvalidArgument
from swarm.model.optim import build_optimizer
from swarm.model.stage_state import export_state
from swarm.model.state_checks import StateChecks
from swarm.model.transformer import build_stage, stage_layout
from tests.support.jobs import make_job

LLAMA = {"kind": "llama", "vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 2}


@pytest.mark.parametrize("model", [{}, LLAMA])
def test_the_layout_is_the_stages_names_shapes_and_dtypes(tmp_path: Path, model: dict) -> None:
    job = make_job(tmp_path, model=model, training={"dtype": "float32"})
    for stage in range(job.training.stages):
        layout, built = stage_layout(job, stage), build_stage(job, stage)
        assert all(t.is_meta for t in layout.state_dict().values())
        assert {k: (v.shape, v.dtype) for k, v in layout.state_dict().items()} == {
            k: (v.shape, v.dtype) for k, v in built.state_dict().items()
        }


@pytest.mark.parametrize("delayed", [False, True])
def test_a_replicas_state_after_a_step_and_its_update_pass(tmp_path: Path, delayed: bool) -> None:
    job = make_job(tmp_path, training={"delayed_update": delayed})
    module = build_stage(job, 1)
    optimizer = build_optimizer(list(module.parameters()), job.optimizer)
    module(torch.randn(2, 4, job.model.d_model, dtype=torch.float64)).square().sum().backward()
    optimizer.step()
    state = export_state(module, optimizer)
    if delayed:
        state |= {f"prev/{k}": p.detach() for k, p in module.named_parameters()}
    checks = StateChecks(job, 1)  # from the layout: no values
    for name, tensor in state.items():
        checks.state_tensor(name, tensor)
    checks.complete(state.keys())
    assert sum(t.nbytes for t in state.values()) <= checks.max_state_bytes()
    for index, p in enumerate(module.parameters()):
        assert p.grad is not None
        checks.update_tensor(index, p.grad)
    assert checks.num_parameters == index + 1
    assert sum(p.grad.nbytes for p in module.parameters()) <= checks.max_update_bytes()


def test_what_the_stage_would_not_load_is_refused(tmp_path: Path) -> None:
    job = make_job(tmp_path)
    checks = StateChecks(job, 1)
    weight = "param/layers.1.ln1.weight"  # [32]
    with pytest.raises(InvalidArgument, match=r"must be torch\.float64 \[32\]"):
        checks.state_tensor(weight, torch.zeros(33, dtype=torch.float64))
    with pytest.raises(InvalidArgument, match=r"got torch\.float32"):
        checks.state_tensor(weight, torch.zeros(32, dtype=torch.float32))
    with pytest.raises(InvalidArgument, match="no parameter"):
        checks.state_tensor("param/layers.2.ln1.weight", torch.zeros(32, dtype=torch.float64))
    with pytest.raises(InvalidArgument, match="not part of stage 1's state"):
        checks.state_tensor("prev/layers.1.ln1.weight", torch.zeros(32, dtype=torch.float64))
    with pytest.raises(InvalidArgument, match="lacks 1 parameters"):
        names = [f"param/{n}" for n in stage_layout(job, 1).state_dict()]
        checks.complete([n for n in names if n != weight])
    with pytest.raises(InvalidArgument, match="gradient sum 0 must be"):
        checks.update_tensor(0, torch.zeros(31, dtype=torch.float64))
    with pytest.raises(InvalidArgument, match="has 12 gradient sums"):
        checks.update_tensor(12, torch.zeros(1, dtype=torch.float64))


@pytest.mark.parametrize(("kind", "keys"), [("adamw", 3), ("sgd", 1), ("sgd0", 0)])
def test_an_optimizer_key_the_jobs_optimizer_lacks_is_refused(
    tmp_path: Path, kind: str, keys: int
) -> None:
    # The keys of the job's optimizer are known (adamw: step, exp_avg, exp_avg_sq; sgd with
    # momentum: momentum_buffer; without: none), so a state holds at most that many a parameter.
    optimizer = {"kind": kind[:3] if kind != "adamw" else kind, "lr": 0.1}
    if kind == "sgd":
        optimizer["momentum"] = 0.9
    job = make_job(tmp_path, optimizer=optimizer, training={"delayed_update": True})
    checks = StateChecks(job, 1)
    module = build_stage(job, 1)
    weight = next(iter(module.parameters()))
    with pytest.raises(InvalidArgument, match=r"'optim/0/k0' .* no key 'k0'"):
        checks.state_tensor("optim/0/k0", torch.zeros((), dtype=torch.uint8))
    params, names = len(list(module.parameters())), len(module.state_dict())
    assert checks.max_state_tensors() == 2 * names + keys * params
    state = export_state(module, build_optimizer(list(module.parameters()), job.optimizer))
    assert not any(k.startswith("optim/") for k in state)  # no step yet: no optimizer state
    if keys:
        key = "exp_avg" if kind == "adamw" else "momentum_buffer"
        checks.state_tensor(f"optim/0/{key}", torch.zeros_like(weight))
        with pytest.raises(InvalidArgument, match=f"optim/0/{key} has 1 values"):
            checks.state_tensor(f"optim/0/{key}", torch.zeros(1, dtype=weight.dtype))
        # of its parameter's shape and dtype, not its count alone: a flat moment, or one of
        # another dtype, loaded and failed at the first step, half applied (after the update
        # was recorded, the sums dropped and the parameters before it stepped)
        for wrong in (weight.reshape(-1), weight.to(torch.float32), weight.to(torch.int64)):
            if weight.dim() == 1 and wrong.dtype == weight.dtype:
                continue  # a vector's flat self is itself
            with pytest.raises(InvalidArgument, match=f"optim/0/{key} must be"):
                checks.state_tensor(f"optim/0/{key}", torch.zeros_like(wrong))
    if kind == "adamw":  # its step: one floating value
        checks.state_tensor("optim/0/step", torch.tensor(3.0))
        for wrong in (torch.tensor(True), torch.tensor(3), torch.zeros(1, 1, 1)):
            with pytest.raises(InvalidArgument, match="optim/0/step must be"):
                checks.state_tensor("optim/0/step", wrong)
