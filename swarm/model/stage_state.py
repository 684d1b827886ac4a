"""The stage-state format every role exchanges (state downloads, checkpoints, rollback, export):
parameters as `param/<name>` and optimizer state as `optim/<param index>/<key>`, on the CPU. And
the seeded initial state of a stage, which every replica builds identically at step 0."""

from __future__ import annotations

import torch

from swarm.errors import InvalidArgument
from swarm.job.config import JobConfig
from swarm.model.optim import build_optimizer
from swarm.model.transformer import build_stage

__all__ = ["export_state", "initial_state", "load_state"]


def export_state(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, include_optimizer: bool = True
) -> dict[str, torch.Tensor]:
    """`module`'s parameters and `optimizer`'s state, copied to the CPU: what a joining replica
    needs to become identical to this one."""
    state = {f"param/{k}": v.detach().cpu().clone() for k, v in module.state_dict().items()}
    if include_optimizer:
        for index, entry in optimizer.state_dict()["state"].items():
            for key, value in entry.items():
                if isinstance(value, torch.Tensor):
                    state[f"optim/{index}/{key}"] = value.detach().cpu().clone()
    return state


def share_state(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, include_optimizer: bool = True
) -> tuple[dict[str, torch.Tensor], set[str]]:
    """`export_state` whose parameters and optimizer tensors (on any device) are the live ones, not
    copies (buffers are copied: a forward may change them); with the names of those shared. Who
    holds it copies them before they change (`stage_server.replica.snapshot`)."""
    params = {id(p) for p in module.parameters()}
    state: dict[str, torch.Tensor] = {}
    shared: set[str] = set()

    def put(name: str, value: torch.Tensor, live: bool) -> None:
        if live and value.is_contiguous():  # cut into chunks in place, each read once (a
            state[name] = value.detach()  # device's copied to the host a chunk at a time)
            shared.add(name)
        elif value.device.type != "cpu":
            state[name] = value.detach().cpu()  # a copy already
        else:
            state[name] = value.detach().clone(memory_format=torch.contiguous_format)

    for k, v in module.state_dict(keep_vars=True).items():
        put(f"param/{k}", v, id(v) in params)
    if include_optimizer:
        for index, entry in optimizer.state_dict()["state"].items():
            for key, value in entry.items():
                if isinstance(value, torch.Tensor):
                    put(f"optim/{index}/{key}", value, True)
    return state, shared


def load_state(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, torch.Tensor]
) -> None:
    """Make `module` and `optimizer` those whose `export_state` this is."""
    params = {k.removeprefix("param/"): v for k, v in state.items() if k.startswith("param/")}
    if params.keys() != module.state_dict().keys():
        raise InvalidArgument("state names differ from the stage's parameters")
    module.load_state_dict(params)
    optim: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in state.items():
        if name.startswith("optim/"):
            _, index, key = name.split("/", 2)
            optim.setdefault(int(index), {})[key] = value
    groups = optimizer.state_dict()["param_groups"]
    optimizer.load_state_dict({"state": optim, "param_groups": groups})


def initial_state(job: JobConfig, stage: int) -> dict[str, torch.Tensor]:
    """Stage `stage`'s state at step 0, from the job's seed (what a rollback to step 0 loads)."""
    module = build_stage(job, stage, torch.device("cpu"))
    return export_state(module, build_optimizer(list(module.parameters()), job.optimizer))
