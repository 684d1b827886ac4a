"""A stage of three replicas (`PEERS`) whose contributions are audited at step 5, as the
coordinator's side of the contributions' audit sees it
(`scheduler.coordinator.trust.contributions`): each member's checksums of a round over given
contributions, as its averaging takes them, and random microbatch gradients to digest."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import cast

import torch

from scheduler.coordinator.ledger import StepLedger
from scheduler.coordinator.trust.contributions import Contributions
from scheduler.coordinator.trust.sum_checks import Checksums
from stage_server.averaging.checksum import AuditedChecks, dots
from swarm.policy.parts import EQUAL_PARTS
from swarm.rpc.lease import GradientDigest, MicrobatchResult, Replica, Task

__all__ = [
    "PEERS",
    "Ledger",
    "N",
    "device_audits",
    "device_step",
    "digests",
    "emulated_tf32",
    "grads",
    "round_of",
    "tf32",
]

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


def tf32(t: torch.Tensor) -> torch.Tensor:
    """`t` (float32) as a GPU's TF32 matmul takes it: 10 bits of mantissa, rounded to nearest."""
    bits = t.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def emulated_tf32(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """x^T·dy as a GPU's TF32 matmul computes it, on the CPU: inputs of 10 bits of mantissa."""
    return tf32(x).T @ tf32(dy)


def device_step(
    seed: int, emulated: int, matmul: Matmul = emulated_tf32
) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """One step of a linear stage (100 x 100 = `N` parameters) over three microbatches per
    replica: each replica's microbatch gradients (x^T·dy, float32) as its own device computes
    them (replica `emulated`'s with `matmul`: TF32 by default, the others' in full float32), and
    as an auditor re-executes them (full float32): (by device, by auditors)."""
    g = torch.Generator().manual_seed(seed)
    mine, audited = [], []
    for i in range(len(PEERS)):
        inputs = [
            (torch.randn(8, 100, generator=g), torch.randn(8, 100, generator=g)) for _ in range(3)
        ]
        exact = [(x.T @ dy).reshape(-1) for x, dy in inputs]
        own = [matmul(x, dy).reshape(-1) for x, dy in inputs] if i == emulated else exact
        mine.append(own)
        audited.append(exact)
    return mine, audited


def digests(
    contributions: Contributions, peer: str, grads: list[torch.Tensor], auditors: str = "x and y"
) -> None:
    """`peer`'s microbatch gradients `grads`, digested under its audit's seed by `auditors`."""
    (audit,) = [a for a in contributions._audits(5, 0) if a.peer == peer]
    for index, g in enumerate(grads):
        dot, magnitude, squares = dots(audit.seed, 0, g)
        digest = GradientDigest(0, peer, dot, magnitude, squares**0.5, auditors, audit.seed)
        result = MicrobatchResult(5, index, {0: peer}, None, 4, digests=(digest,))
        contributions.record(result)


def device_audits(
    steps: int, tolerance: float, matmul: Matmul = emulated_tf32
) -> list[tuple[int, str, str]]:
    """`steps` audited rounds of the three, each step's replica `step % 3` on another kind of
    device (`device_step` with `matmul`), every contribution audited with the job's
    `tolerance`: whom each accused, (step, peer, the evidence)."""
    held = {p: [0, 1, 2] for p in PEERS}
    found = []
    for step in range(steps):
        contributions = Contributions(1.0, random.Random(step), tolerance)
        members = [[Replica(p, p) for p in PEERS]]
        contributions.tasks(cast(StepLedger, Ledger()), [Task(5, 0, frozenset({0}))], members)
        mine, audited = device_step(step, step % len(PEERS), matmul)
        for i, p in enumerate(PEERS):
            digests(contributions, p, audited[i])
        xs = [(g[0] + g[1]) + g[2] for g in mine]
        accused = contributions.judge(5, 0, PEERS, round_of(contributions, xs), held)
        found += [(step, peer, evidence) for peer, evidence in accused]
    return found
