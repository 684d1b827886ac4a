"""A stage's tensors laid end to end in one memory (as a replica's gradient sums, and the
reference's gradients, are) seen as one 1-D tensor: what the commit's norm and scaling, and the
averaging, work on in a few kernels rather than a few per tensor."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["flat_copy", "flat_view"]


def flat_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The 1-D view over `tensors` when each is contiguous and starts where the one before it
    ends, in one storage; else None."""
    first = tensors[0].detach()
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for t in tensors:
        if not t.is_contiguous() or t.untyped_storage().data_ptr() != storage:
            return None
        if t.storage_offset() != offset:
            return None
        offset += t.numel()
    return first.as_strided((offset - first.storage_offset(),), (1,))


def flat_copy(tensors: Sequence[torch.Tensor], fill: float | None = None) -> list[torch.Tensor]:
    """Copies of `tensors` (or, with `fill`, tensors like them holding that value) as views of
    one flat tensor, when they share a dtype and device (else one tensor each)."""
    if len({(t.dtype, t.device) for t in tensors}) != 1:
        return [t.detach().clone() if fill is None else torch.full_like(t, fill) for t in tensors]
    first = tensors[0]
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=first.dtype, device=first.device)
    if fill is not None:
        flat.fill_(fill)
    views, start = [], 0
    for t in tensors:
        view = flat[start : start + t.numel()].view(t.shape)
        if fill is None:
            view.copy_(t.detach())
        views.append(view)
        start += t.numel()
    return views
