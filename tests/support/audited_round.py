"""A stage of three replicas (`PEERS`) whose contributions are audited at step 5, as the
coordinator's side of the contributions' audit sees it (`scheduler.coordinator.contributions`):
each member's checksums of a round over given contributions, as its averaging takes them, and
random microbatch gradients to digest."""

from __future__ import annotations

import torch

from scheduler.coordinator.contributions import Contributions
from scheduler.coordinator.sum_checks import Checksums
from stage_server.averaging.checksum import AuditedChecks
from swarm.policy.parts import EQUAL_PARTS

__all__ = ["PEERS", "Ledger", "N", "grads", "round_of"]

PEERS = ["a", "b", "c"]
N = 10_000  # elements of the stage's flat gradient


class Ledger:
    """A step's ledger, as far as the draw reads it."""

    step = 5


def round_of(contributions: Contributions, xs: list[torch.Tensor]) -> dict[int, Checksums]:
    """A round of the three over `xs` (their contributions), each member's checksums as its
    averaging takes them: every part contributed, and its sum taken back."""
    total = xs[0] + xs[1] + xs[2]
    parts = EQUAL_PARTS.bounds(N, len(PEERS))
    out = {}
    for i, peer in enumerate(PEERS):
        seeds = contributions.seeds_for(5, 0, peer)
        checks = AuditedChecks(7, seeds)
        for k, part in enumerate(parts):
            checks.contributed(k, part.start, xs[i][part])
            checks.summed(k, part.start, total[part])
        out[i] = Checksums(7, list(checks.report()), seeds, checks.audit_report())
    return out


def grads(seed: int) -> list[torch.Tensor]:
    """Three microbatches' gradients of the stage."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(N, generator=g, dtype=torch.float64) for _ in range(3)]
