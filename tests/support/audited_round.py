"""A stage of three replicas (`PEERS`) whose contributions are audited at step 5, as the
coordinator's side of the contributions' audit sees it (`scheduler.coordinator.contributions`):
each member's checksums of a round over given contributions, as its averaging takes them, and
random microbatch gradients to digest."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from scheduler.coordinator.contributions import Contributions
from scheduler.coordinator.sum_checks import Checksums
from stage_server.averaging.checksum import AuditedChecks, dots
from swarm.policy.parts import EQUAL_PARTS

__all__ = ["PEERS", "Ledger", "N", "grads", "round_of"]

PEERS = ["a", "b", "c"]
N = 10_000  # elements of the stage's flat gradient


class Ledger:
    """A step's ledger, as far as the draw reads it."""

    step = 5


def round_of(
    contributions: Contributions,
    xs: list[torch.Tensor],
    lie: Mapping[int, float] | None = None,
) -> dict[int, Checksums]:
    """A round of the three over `xs` (their contributions), each member's checksums as its
    averaging takes them: every part contributed, and its sum taken back; each owner's words
    about what every sender sent its part, as its averaging sums them. `lie`: member 2's q-words
    about what it sent to part k moved by `lie[k]` (a liar about its own contribution)."""
    lie = lie or {}
    total = xs[0] + xs[1] + xs[2]
    parts = EQUAL_PARTS.bounds(N, len(PEERS))
    out = {}
    for i, peer in enumerate(PEERS):
        seeds = contributions.seeds_for(5, 0, peer)
        checks = AuditedChecks(7, seeds)
        for k, part in enumerate(parts):
            checks.contributed(k, part.start, xs[i][part])
            checks.summed(k, part.start, total[part])
        audit = checks.audit_report()
        for c in audit:
            seed = seeds[c.seed_index]
            if c.part == i:  # its own part: its words about what each sender sent
                words = [dots(seed, parts[i].start, xs[s][parts[i]]) for s in range(3)]
                c.received_dots.extend(w[0] for w in words)
                c.received_magnitudes.extend(w[1] for w in words)
            elif i == 2:
                c.dot += lie.get(c.part, 0.0)
        out[i] = Checksums(7, list(checks.report()), seeds, audit)
    return out


def grads(seed: int) -> list[torch.Tensor]:
    """Three microbatches' gradients of the stage."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(N, generator=g, dtype=torch.float64) for _ in range(3)]
