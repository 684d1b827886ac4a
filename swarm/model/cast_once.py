"""bf16-mixed weights cast once per step, not once per microbatch.

Under `torch.autocast` each matmul casts its float32 weight to bfloat16, and autocast keeps the
cast for reuse only until the outermost autocast region exits. A stage computes one microbatch
per call, each call its own region: every microbatch cast every weight again (a 1B model: ~2 GB
of memory traffic a microbatch), and each microbatch's graph held its own copy. `casting_once`
keeps the thread's cast cache across calls while the parameters stay the same tensors at the
same version: their first forward of a step casts, the others reuse those casts (the same bits:
a cast is a pure function of the weight), and an optimizer step, a loaded state or another set
of parameters (a delayed update's copy) bumps the key and drops them. Gradients flow through the
one cast into the float32 sums as before.

Safe beside other autocast users on the thread (the reference in a test): the nesting autocast
counts goes back to where it was after each call, so any other region still clears the cache as
it exits (a re-cast, never a stale one), and a cast made without gradient history (a validation
forward, under no_grad) is never reused by a forward that needs it: the grad mode is in the key.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager

import torch

from swarm.job.config import JobConfig
from swarm.model.transformer import precision

__all__ = ["casting_once"]

_local = threading.local()  # autocast's cache and nesting are per thread: so is what it caches


def _key(params: Sequence[torch.Tensor]) -> tuple[bool, tuple[tuple[int, int], ...]]:
    return torch.is_grad_enabled(), tuple((id(p), p._version) for p in params)


@contextlib.contextmanager
def casting_once(params: Sequence[torch.Tensor]) -> Iterator[None]:
    """Around a call's autocast region: the casts of `params` made by an earlier call (at the
    same version, in the same grad mode) are reused, and this call's are kept for the next."""
    key = _key(params)
    if getattr(_local, "key", None) != key:
        torch.clear_autocast_cache()  # another step's, another module's, or another mode's
    torch.autocast_increment_nesting()  # the region inside exits to 1, not 0: no clearing
    try:
        yield
    finally:
        torch.autocast_decrement_nesting()  # back as it was; the cache stays until cleared
        _local.key = _key(params)  # the versions after the call (a forward changes none)


def step_precision(
    job: JobConfig, device: torch.device, params: Callable[[], Sequence[torch.Tensor]]
) -> AbstractContextManager[None]:
    """Where a step computes: the job's precision (`transformer.precision`); in bf16-mixed with
    `params()`' casts made once while they stay as they are, not once per microbatch."""
    if job.training.precision != "bf16-mixed":
        return precision(job, device)  # type: ignore[no-any-return]
    stack = contextlib.ExitStack()
    stack.enter_context(casting_once(params()))
    stack.enter_context(precision(job, device))
    return stack  # type: ignore[return-value]
