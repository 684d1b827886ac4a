"""A round's checksums made by hand (`pb.SumCheck`, as each contributor reports them), for the
trust checks' unit tests: every member sending 1.0 to every part unless told otherwise, an
owner's words of what it summed, and a NaN hidden in one owner's part."""

from __future__ import annotations

from typing import Any

from scheduler.coordinator.trust.sum_checks import Checksums
from swarm.proto import stage_pb2 as pb

__all__ = ["NAN", "nan_to_part", "word_checks"]

NAN = float("nan")


def word_checks(
    said: dict[tuple[int, int], float] | None = None,
    received: dict[tuple[int, int], float] | None = None,
    sums: dict[tuple[int, int], float] | None = None,
    m: int = 3,
) -> dict[int, Checksums]:
    """`m` replicas owning a part each, each sending 1.0 (r·x, of magnitude and norm 1) to
    every part; part k's sum as j took it back has r·S = `sums[j, k]` (else m, the honest
    sum's). Member j says it sent r·x = `said[j, k]` to part k (else 1.0); owner k says it
    received `received[k, j]` from j (else 1.0)."""
    said, received, sums = said or {}, received or {}, sums or {}
    out = {}
    for j in range(m):
        reports = []
        for k in range(m):
            check = pb.SumCheck(part=k, magnitude=1.0, norm=1.0, sum_norm=2.0)
            check.dot = said.get((j, k), 1.0)
            check.sum_dot = sums.get((j, k), float(m))
            if k == j:  # its own part: what it summed, sender by sender
                check.received.extend([1.0] * m)
                check.received_dots.extend([received.get((k, i), 1.0) for i in range(m)])
                check.received_magnitudes.extend([1.0] * m)
            reports.append(check)
        out[j] = Checksums(1, reports)
    return out


def nan_to_part(
    owner: int, senders: tuple[int, ...], *, sums: float = NAN, m: int = 3, **kw: Any
) -> dict[int, Checksums]:
    """`m` members: `owner` says `senders` sent its part a NaN (its words and its squares of
    them), and the sum every member took back of it has r·S and ‖S‖ `sums` (NaN: an honest
    owner's then); each sender saying what `kw`'s `said` has it say."""
    checks = word_checks(
        received={(owner, j): NAN for j in senders},
        sums={(j, owner): sums for j in range(m)},
        m=m,
        **kw,
    )
    for j, c in checks.items():
        c.reports[owner].sum_norm = sums
        if j == owner:
            for i in senders:
                c.reports[owner].received[i] = NAN
    return checks
