"""What a state of one stage (`swarm.model.stage_state`'s format) and the updates a replica
applied may hold, checked tensor by tensor as they arrive, by everyone who receives one: a
replica loading a state (LoadState), a joining replica copying a member (its state, then its
updates), the scheduler checkpointing or exporting a stage.

Why one place: a peer sends these, so a receiver must know what to expect before it holds what
came: a total it may not pass (a sender must not size the receiver's memory), the names, shapes
and dtypes of the stage's parameters (a wrong one must be refused where it arrives, not become a
checkpoint no replica will load). The checks depend only on the job and the stage's structure,
never on parameter values, so every receiver builds the same ones (the scheduler from the
stage's layout on the meta device, a replica from its own module)."""

from __future__ import annotations

import functools
from collections.abc import Collection

import torch

from swarm.errors import InvalidArgument
from swarm.job.config import JobConfig, OptimizerConfig
from swarm.job.rule import rule_of
from swarm.model.optim import build_optimizer
from swarm.model.transformer import stage_layout
from swarm.wire.chunking import TENSOR_OVERHEAD_BYTES

__all__ = ["StateChecks"]

_SCALARS_BYTES = 1 << 20  # an optimizer's scalars (steps) and the names: a margin on the total


@functools.lru_cache(maxsize=16)
def optimizer_keys(cfg: OptimizerConfig) -> dict[str, bool]:
    """The tensors the job's optimizer keeps a parameter (`optim/<index>/<key>`), each True when
    it holds one value a parameter's value (a moment), False when it is one value (a step
    counter): read off the optimizer itself after a step of a two-value parameter."""
    probe = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    optimizer = build_optimizer([probe], cfg)
    probe.grad = torch.ones_like(probe)
    optimizer.step()
    entry = optimizer.state_dict()["state"].get(0, {})
    return {k: v.numel() != 1 for k, v in entry.items() if isinstance(v, torch.Tensor)}


class StateChecks:
    """Checks for a state of stage `stage` of `job`, whose module is `module` (by default the
    stage's layout: shapes and dtypes, no values)."""

    def __init__(self, job: JobConfig, stage: int, module: torch.nn.Module | None = None) -> None:
        module = stage_layout(job, stage) if module is None else module
        self.stage = stage
        self.delayed = rule_of(job).delays
        # Names a state of this job may hold beside `param/`: the parameters before the last
        # update (delayed_update), the round's start and outer momentum (pool.mode = "local"),
        # and under an eager rule its last share and the last average it holds, each with the
        # round it is of (`round/shared`, `round/averaged`): the rule says which
        rule = rule_of(job)
        self._copies: tuple[str, ...] = rule.state_copies
        self._markers = set(rule.state_markers)
        params = list(module.parameters())  # by optimizer index: an update's order too
        self._params = [(p.shape, p.dtype) for p in params]
        self._state = {f"param/{k}": (v.shape, v.dtype) for k, v in module.state_dict().items()}
        self._values = sum(shape.numel() for shape, _ in self._state.values())
        self._keys = optimizer_keys(job.optimizer)

    @property
    def num_parameters(self) -> int:
        """How many gradient sums one update holds (one per parameter, in optimizer order)."""
        return len(self._params)

    def update_shapes(self) -> list[torch.Size]:
        """The shapes of one update's gradient sums, in optimizer order: how a flat sum that came
        whole (in the averaging's codec, `swarm.rpc.state_streams.Update.encoded`) is cut."""
        return [shape for shape, _ in self._params]

    def max_state_bytes(self) -> int:
        """The most bytes a state for this stage can take (parameters, their copies, and an
        optimizer's state of at most three tensors per parameter, at 8 bytes a value, and a
        little for scalars):
        more is refused, whoever sends it."""
        return (
            (3 + len(self._copies)) * 8 * self._values  # with adamw's two moments
            + _SCALARS_BYTES
            + TENSOR_OVERHEAD_BYTES * self.max_state_tensors()  # as a receiver charges each
        )

    def max_state_tensors(self) -> int:
        """The most tensors a state for this stage can hold: its parameters (twice with
        delayed_update) and the optimizer's keys for each (at most three: adamw's step and
        moments): more is refused, however few bytes each."""
        copies = 1 + len(self._copies)
        markers = len(self._markers)  # `round/synced` and the like
        return len(self._state) * copies + len(self._params) * len(self._keys) + markers

    def max_update_bytes(self) -> int:
        """The most bytes one update can take: a gradient sum per parameter, at 8 bytes a
        value (a replica's update log keeps its last update whatever its bound)."""
        return 8 * sum(shape.numel() for shape, _ in self._params)

    def state_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """One tensor of a state must be one of this stage's (`swarm.model.stage_state` names):
        `param/<name>` (or, with delayed_update, `prev/<name>`: the parameters before the last
        update) with its parameter's shape and dtype, or `optim/<index>/<key>` of a parameter
        with that parameter's size or one value, under a key the job's optimizer keeps."""
        if name in self._markers:  # pool.mode = "local"
            if tensor.dtype != torch.int64 or tensor.numel() != 1:
                raise InvalidArgument(
                    f"{name} must be one int64; got {tensor.dtype} {tensor.numel()}"
                )
            return
        if name.startswith(("param/", *self._copies)):
            expected = self._state.get("param/" + name.split("/", 1)[1])
            if expected is None:
                raise InvalidArgument(f"stage {self.stage} has no parameter {name!r}")
            shape, dtype = expected
            if tensor.shape != shape or tensor.dtype != dtype:
                raise InvalidArgument(
                    f"{name} must be {dtype} {list(shape)}; got {tensor.dtype} {list(tensor.shape)}"
                )
            return
        parts = name.split("/", 2)
        if len(parts) == 3 and parts[0] == "optim" and parts[1].isdecimal():
            index = int(parts[1])
            if index < len(self._params):
                per_value = self._keys.get(parts[2])
                if per_value is None:
                    raise InvalidArgument(
                        f"{name!r} is not part of stage {self.stage}'s state: the job's optimizer "
                        f"has no key {parts[2]!r} (only {sorted(self._keys)})"
                    )
                shape, dtype = self._params[index]
                size = shape.numel() if per_value else 1
                if tensor.numel() != size:
                    raise InvalidArgument(
                        f"{name} has {tensor.numel()} values; parameter {index} has "
                        f"{shape.numel()}" + ("" if per_value else ", this key 1")
                    )
                # its parameter's shape and dtype (a moment), or one floating value (a step):
                # another loads, and fails the first step half applied
                if per_value and (tensor.shape != shape or tensor.dtype != dtype):
                    raise InvalidArgument(
                        f"{name} must be {dtype} {list(shape)}, as parameter {index}; got "
                        f"{tensor.dtype} {list(tensor.shape)}"
                    )
                if not per_value and (tensor.dim() or not tensor.dtype.is_floating_point):
                    raise InvalidArgument(
                        f"{name} must be one floating value; got {tensor.dtype} "
                        f"{list(tensor.shape)}"
                    )
                return
        raise InvalidArgument(
            f"{name!r} is not part of stage {self.stage}'s state (param/<name>, or "
            f"optim/<parameter index below {len(self._params)}>/<key>)"
        )

    def complete(self, names: Collection[str]) -> None:
        """A whole state (every tensor of which passed `state_tensor`) has every parameter."""
        missing = [n for n in self._state if n not in names]
        if missing:
            shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
            raise InvalidArgument(
                f"stage {self.stage}'s state lacks {len(missing)} parameters: {shown}"
            )

    def update_tensor(self, index: int, tensor: torch.Tensor) -> None:
        """Gradient sum `index` of an update: parameter `index`'s shape and dtype."""
        if not 0 <= index < len(self._params):
            raise InvalidArgument(
                f"an update of stage {self.stage} has {len(self._params)} gradient sums; got "
                f"number {index}"
            )
        shape, dtype = self._params[index]
        if tensor.shape != shape or tensor.dtype != dtype:
            raise InvalidArgument(
                f"gradient sum {index} must be {dtype} {list(shape)}; got {tensor.dtype} "
                f"{list(tensor.shape)}"
            )
