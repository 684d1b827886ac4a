"""An answer as an audit compares it: decoded where it came as it went on the wire (`decoded`), and
how far it is from another's (`differs`): a producer's from an auditor's re-execution, or two
auditors' from each other (`client.audit.audits`)."""

from __future__ import annotations

import torch

from swarm.rpc.stage_client import TensorLike
from swarm.wire import codec

__all__ = ["decoded", "differs"]


def decoded(value: TensorLike | None) -> torch.Tensor | None:
    """A tensor as sent or received (encoded or not) as a tensor."""
    if value is None or isinstance(value, torch.Tensor):
        return value
    return codec.decode(value)


def differs(claimed: torch.Tensor | None, honest: torch.Tensor | None) -> float:
    """How far `claimed` is from `honest`: the largest difference relative to `honest`'s
    largest element (inf for another shape, a NaN or one missing; 0.0 when bitwise equal)."""
    if claimed is None or honest is None:
        return 0.0 if claimed is None and honest is None else float("inf")
    if claimed.shape != honest.shape:
        return float("inf")
    a, b = claimed.double(), honest.double()
    if torch.equal(a, b):
        return 0.0
    scale = float(b.abs().max()) if b.numel() else 0.0
    gap = float((a - b).abs().max())
    return gap / scale if scale > 0 and gap == gap else float("inf")
