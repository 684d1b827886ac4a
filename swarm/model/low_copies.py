"""bf16-mixed: each matmul weight's bfloat16 copy, made once while the weight stays as it is, and
its gradient added straight into the weight's float32 sum.

Under autocast a matmul casts its float32 weight to bfloat16 and the cast's backward turns the
bfloat16 gradient back into a float32 tensor, which autograd then adds into the weight's `.grad`
(a replica's step sums, the reference's flat gradients): per weight and microbatch one float32
gradient written whole and read again beside the sums. Here the stage runs with each `nn.Linear`
parameter replaced by its bfloat16 copy (`torch.func.functional_call`, as the reference runs a
delayed update's weights) through `_Cast`, whose backward, while a backward `into_grads` runs,
adds the bfloat16 gradient into the float32 `.grad` in one kernel and hands autograd nothing.
The same bits: widening bfloat16 to float32 is exact, and `sum.add_(g)` adds in float32 what
`sum += g.float()` adds. Outside `into_grads` (a gradient taken and not summed: a duplicate
microbatch's, `torch.autograd.grad`) the backward is autocast's, the gradient handed on as
float32.

Autocast casts nothing else of these weights (a bfloat16 tensor is already what a matmul wants),
and a weight a module other than a Linear also uses (tied) keeps autocast's casts: that module
must see the float32 weight. A copy is made again when its weight's version moves (an optimizer
step, a loaded state), never changed in place: a graph still held reads the copy it saved.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from swarm.job.config import JobConfig

__all__ = ["LowCopies", "castable"]

LOW = torch.bfloat16


def _nothing(_: torch.Tensor) -> None:
    pass


@dataclass(frozen=True)
class _Into:
    """A backward adding into the `.grad`s: `reaching(w)` before `w`'s gradient is added, and
    `landed(w)` after (what `stage_server.replica.accumulate` watches a backward with)."""

    reaching: Callable[[torch.Tensor], None]
    landed: Callable[[torch.Tensor], None]


class _Cast(torch.autograd.Function):
    """`weight`'s bfloat16 copy; backward: into `weight.grad`, or handed on as float32."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, copies: LowCopies) -> torch.Tensor:  # type: ignore[override]
        low = copies.low(weight)
        # ctx keeps the weight itself, not a saved tensor: as autocast's cast, the graph does
        # not check the weight's version (its copy, which the graph saves, never changes).
        ctx.weight, ctx.copies = weight, copies
        # A new tensor over the copy's memory, not a view of it: autograd attaches this call's
        # history to it, never to the cached copy that every call shares.
        alias = torch.empty(0, dtype=low.dtype, device=low.device)
        return alias.set_(low.untyped_storage(), low.storage_offset(), low.shape, low.stride())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:  # type: ignore[override]
        weight, into = ctx.weight, ctx.copies.into
        if into is None or weight.grad is None:
            return grad.to(weight.dtype), None
        into.reaching(weight)
        weight.grad.add_(grad)  # float32 += bfloat16, in float32: the sum's own bits
        into.landed(weight)
        return None, None


class LowCopies:
    """One model's (a replica's, the reference's) bfloat16 copies of its Linear weights."""

    def __init__(self) -> None:
        self._copies: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weight -> (version, copy)
        self._names: WeakIdKeyDictionary = WeakIdKeyDictionary()  # module -> castable names
        # Set while a backward adds into the `.grad`s; read by `_Cast.backward`, which on CUDA
        # runs on autograd's device thread, not the caller's: so an attribute, not a local.
        self.into: _Into | None = None
        self.active = 0  # inside `call`: the hooked Linears compute on the copies

    @classmethod
    def of(cls, job: JobConfig) -> LowCopies | None:
        """A model's copies under `job`'s precision: bf16-mixed's; None for any other."""
        return cls() if job.training.precision == "bf16-mixed" else None

    def low(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight`'s bfloat16 copy at its current version."""
        held = self._copies.get(weight)
        if held is None or held[0] != weight._version:
            with torch.no_grad():
                held = (weight._version, weight.detach().to(LOW))
            self._copies[weight] = held
        return held[1]  # type: ignore[no-any-return]

    def call(
        self,
        module: nn.Module,
        args: tuple[Any, ...],
        weights: dict[str, torch.Tensor] | None = None,
    ) -> Any:
        """`module(*args)` (with `weights` in place of its parameters, if given) with its
        castable weights as their bfloat16 copies: under bf16 autocast, what it computes."""
        if self._names.get(module) is None:
            self._names[module] = castable(module)
            for name in {n.rpartition(".")[0] for n in self._names[module]}:
                _hook(module.get_submodule(name), self)
        self.active += 1
        try:
            if weights is None:
                return module(*args)
            return torch.func.functional_call(module, weights, args)
        finally:
            self.active -= 1

    @contextlib.contextmanager
    def into_grads(
        self,
        reaching: Callable[[torch.Tensor], None] = _nothing,
        landed: Callable[[torch.Tensor], None] = _nothing,
    ) -> Iterator[None]:
        """A backward inside adds the copies' gradients into their weights' `.grad` (where one
        is set), calling `reaching` and `landed` around each add."""
        self.into = _Into(reaching, landed)
        try:
            yield
        finally:
            self.into = None


def _hook(linear: nn.Module, copies: LowCopies) -> None:
    """`linear`'s weights swapped for their copies while it computes inside `copies.call`. The
    cast is made where the weight is used, not before the module runs: its backward node then
    comes right after the Linear's in autograd's order (later nodes first), so each gradient is
    added as soon as it exists and no bfloat16 gradient waits for the whole backward. Closures,
    not bound methods: a module deep-copied (a delayed update's copy) keeps them, sharing
    `copies`, and is marked hooked already."""
    if getattr(linear, "_swarm_low_copies", False):
        return
    linear._swarm_low_copies = True  # type: ignore[assignment]
    held: list[dict[str, torch.Tensor]] = []  # per call of the module, what was swapped out

    def before(m: nn.Module, _: Any) -> None:
        swapped: dict[str, torch.Tensor] = {}
        if copies.active:
            for name in ("weight", "bias"):
                w = m._parameters.get(name)
                if w is not None and w.dtype == torch.float32:
                    swapped[name] = w
                    m._parameters[name] = _Cast.apply(w, copies)
        held.append(swapped)

    def after(m: nn.Module, _: Any, __: Any) -> None:
        for name, w in held.pop().items():
            m._parameters[name] = w  # type: ignore[assignment]

    linear.register_forward_pre_hook(before)
    linear.register_forward_hook(after, always_call=True)


def castable(module: nn.Module) -> tuple[str, ...]:
    """The names of `module`'s float32 parameters that only `nn.Linear`s use: those autocast
    casts to bfloat16 wherever they are used."""
    owners: dict[int, list[nn.Module]] = {}
    named: dict[int, str] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for name, p in sub.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(p), []).append(sub)
            named.setdefault(id(p), f"{prefix}.{name}" if prefix else name)
    return tuple(
        named[id(p)]
        for p in module.parameters()
        if p.dtype == torch.float32 and all(isinstance(m, nn.Linear) for m in owners[id(p)])
    )
