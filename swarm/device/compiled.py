"""A stage's forward compiled for its fixed microbatch shapes on CUDA (`--compile-stage`): one
graph of fused kernels in place of the ~1,000 small ones eager PyTorch launches a stage call,
its backward compiled with it (AOTAutograd). Eager stays the CPU path and the reference: a CPU
never compiles, whatever the switch says, so CPU replicas and `swarm local` agree bitwise as
ever; compiled CUDA replicas agree with the reference within the bf16 or float32 rounding a
fused kernel brings (bench/gpu_ratio.py measures both). Shapes are fixed (`dynamic=False`): a
microbatch of another size (a step's smaller last one) compiles once more, then reuses it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["CompiledRuns", "Run", "compiles", "inductor"]


def compiles(asked: bool, device: torch.device) -> bool:
    """Whether a stage on `device` runs compiled: only when asked, and only on CUDA."""
    return asked and device.type == "cuda"


Run = Callable[[torch.Tensor], torch.Tensor]


def inductor(module: nn.Module) -> Run:
    """`module` compiled for the device: fused kernels (torch's default backend, inductor)."""
    return torch.compile(module, dynamic=False)  # type: ignore[return-value]


class CompiledRuns:
    """Each module (a replica's own, or a delayed update's copy) compiled once, on first use, by
    `compile` (`inductor`; on a CPU the stand-in `swarm.device.standin.traced`)."""

    def __init__(self, compile: Callable[[nn.Module], Run] = inductor) -> None:
        self._compile = compile
        self._runs: weakref.WeakKeyDictionary[nn.Module, Run] = weakref.WeakKeyDictionary()

    def run(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        fn = self._runs.get(module)
        if fn is None:
            fn = self._compile(module)
            self._runs[module] = fn
        return fn(x)
