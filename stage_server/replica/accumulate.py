"""A microbatch's backward into its step's sums (`stage_server.replica.step_sums`), and its receipt
only once the sums hold the whole of it.

Autograd adds each parameter's gradient into the sums as it makes them (a parameter's `.grad` is
its sum while the backward runs): the same bits as adding the gradients after, without the whole
gradient existing once more beside the sums. A backward that raises half way (a device out of
memory is an ordinary exception on a GPU) has then added some of the microbatch's gradients and
not the others. No receipt is given for it, and sums that a gradient of it reached are withdrawn
whole (`StepSums.withdraw`): no copy of them as they were exists to restore, and keeping one for
every backward would cost the very memory the in-place add saves. Their other microbatches'
receipts go with them, so a PREPARE naming those fails its receipt check and the coordinator
replays them: a rare failure costs replays, never a wrong gradient. A backward that fails before
any gradient reached the sums leaves them as they were.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

import torch

from stage_server.replica.step_sums import StepSums
from swarm.device.oom import out_of_memory
from swarm.model.low_copies import LowCopies

__all__ = ["backprop_into"]

log = logging.getLogger(__name__)


def backprop_into(
    sums: StepSums,
    index: int,
    samples: int,
    shapes: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    x: torch.Tensor,
    out: torch.Tensor,
    grad: torch.Tensor | None,
    want_x: bool,
    fail: str = "",
    low: LowCopies | None = None,
    run: int = 0,
) -> torch.Tensor | None:
    """Backward of `out` adding `params`' gradients into `sums` (made like `shapes`, the
    module's parameters) in place, then the receipt of microbatch `index` (`samples`); the
    gradient of `x` when `want_x`. `fail` (a fault's name, `swarm.ops.faults`): raise an
    out-of-memory error inside the backward, once the first gradient reached the sums. `low`:
    the bf16-mixed weight copies `out` was computed with, whose gradients add into the sums
    inside their casts' backward (`swarm.model.low_copies`), watched the same way. `run`: the
    push-plane run the receipt is under (`StepSums.runs`)."""
    accum = sums.open(shapes)
    reached = False

    def reaching(_: torch.Tensor) -> None:  # a gradient is about to be added to its sum
        nonlocal reached
        reached = True

    def landed(_: torch.Tensor) -> None:  # and was
        if fail:
            raise out_of_memory(f"CUDA out of memory (injected: SWARM_FAULTS {fail})")

    hooks = [p.register_hook(reaching) for p in params]
    if fail:
        hooks += [p.register_post_accumulate_grad_hook(landed) for p in params]
    for p, acc in zip(params, accum, strict=True):
        p.grad = acc
    into = low.into_grads(reaching, landed) if low is not None else contextlib.nullcontext()
    try:
        with into:
            torch.autograd.backward(out, grad, inputs=[*params, x] if want_x else list(params))
        grad_x = x.grad if want_x else None
    except BaseException:
        if reached:
            withdrawn = sums.withdraw()
            if withdrawn:
                log.warning(
                    "a backward failed half way: withdrew the sums of microbatches %s with it "
                    "(the coordinator replays them)",
                    withdrawn,
                )
        raise
    finally:
        for hook in hooks:
            hook.remove()
        for p in params:
            p.grad = None
    sums.received(index, samples, run)
    return grad_x
