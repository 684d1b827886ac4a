"""Which replicas a round's sum checks convict of lying (issue 55, item 2): banned (`Bans`),
not only left out (`sum_checks.replicas_to_leave_out`).

A failed `r·S` against the members' own words proves nothing: a member that reports a wrong
r·x_j of its own contribution moves Σ_j r·x_j, and every contributor's `r·S` fails alike. Each
replica owner now says what each sender sent it, as it summed it (`SumCheck.received_dots`),
and the expected Σ r·x is its words (`sent_words`). What no single other can make, three kinds
of evidence convict:
- **its own word**: the owner's own report of the sum it answered fails against its own words
  about what it summed, under the round's seed r or an audit's q: its r·S (or q·S), or the
  sum's norm past the ceiling its own report of each sender's squared norm sets
  (`norm_ceiling`, `SumCheck.received`). Nobody else's word is in it. This convicts a forgery
  within the norms, which before was only left out;
- **two others' words**: two other contributors or more each took back a sum that fails the
  same way. A lying member can report one such sum (its own), never another's, so with at most
  one liar in the pool (the audits' own premise: two auditors that agree are believed) one of
  them is honest, and an honest contributor's sum came from the owner;
- **two disagreements**: a member whose words about what it sent disagree with two owners'
  about what they received, or an owner whose words disagree with two members'
  (`sent_words.liars`: framing an honest one takes two liars); a word that a NaN or an
  infinity went over, against another's that finite values did, is a disagreement too.
Anything less (one accuser, one disagreement, an owner that said no words of what it summed, a
part an aggregator owns, a NaN or infinite norm or sum) convicts no one. What this cannot
convict: an owner that forges its sum and its word about its own contribution alike, with r·e
= 0 (it knows r) and within the norms: the contributions' audit's, when it is audited
(docs/decisions.md, "Sum liars banned").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from scheduler.coordinator.groups import RoundGroup
from scheduler.coordinator.trust.sent_words import by_seed, disagreements, liars, owner_tolerance
from scheduler.coordinator.trust.sum_checks import Checksums, hosts_of, norm_ceiling, owner_words
from swarm.ops.totals import reported_sum
from swarm.proto import stage_pb2 as pb

__all__ = ["convicted"]

ACCUSERS = 2  # the fewest others whose sums convict an owner (one of them may lie)


def convicted(
    groups: Mapping[int, RoundGroup], checks: Mapping[int, Mapping[int, Checksums]]
) -> dict[int, dict[int, str]]:
    """The replicas a round's checksums (`checks`: stage -> contributor -> what it answered)
    convict: owners of answering a wrong sum, members or owners of lying about what they sent
    or received; stage -> group index -> the evidence, in one line."""
    found: dict[int, dict[int, str]] = {}
    for stage, of in checks.items():
        m = len(groups[stage].members) - len(groups[stage].aggregators)
        if m < 2 or sorted(of) != list(range(m)):
            continue  # not every contributor answered: nothing is judged (`mismatches`)
        seeds = by_seed(of)
        # the host each member's seat is on: two accusers of one host are one word (issue 64)
        hosts = hosts_of(groups[stage])
        for owner in range(m):
            evidence = _evidence(owner, seeds["r"], m, hosts) or _forged(owner, seeds, m, hosts)
            if evidence is not None:
                found.setdefault(stage, {})[owner] = evidence
        for j, evidence in liars(disagreements(seeds, m), hosts).items():
            found.setdefault(stage, {}).setdefault(j, evidence)
    return found


def _forged(
    owner: int,
    seeds: Mapping[str, Mapping[int, Sequence[pb.SumCheck]]],
    m: int,
    hosts: Sequence[str],
) -> str | None:
    """Why replica `owner`'s sum of its own part fails against its own words about what it
    summed, under some seed (its own report of the sum, or two others'), or None."""
    for seed, reports in seeds.items():
        of = {j: c for j, checks in reports.items() for c in checks if c.part == owner}
        words, mine = owner_words(of, owner, m), of.get(owner)
        if words is None or mine is None:
            continue
        expected = reported_sum(w[0] for w in words)
        allowed = owner_tolerance(of, owner, words, m)
        # A NaN or infinite sum is no evidence (`_evidence`): finite values may overflow.
        past = [
            j
            for j, c in sorted(of.items())
            if math.isfinite(c.sum_dot) and abs(c.sum_dot - expected) > allowed
        ]
        found = _witness(owner, past, hosts)
        if found is None:
            continue
        witness, by = found
        return (
            f"the sum it answered for its part has {seed}·S = {of[witness].sum_dot!r}, {by}, "
            f"where what it says it summed gives Σ {seed}·x = {expected!r} (a forgery within "
            "the norms)"
        )
    return None


def _evidence(
    owner: int, reports: Mapping[int, list[pb.SumCheck]], m: int, hosts: Sequence[str]
) -> str | None:
    """Why replica `owner`'s sums of its own part convict it, or None."""
    of = {j: c for j, checks in reports.items() for c in checks if c.part == owner}
    mine = of.get(owner)
    if len(of) < m or mine is None or len(mine.received) != m:
        return None  # the ceiling would rest on the members' own norms: a liar could lower it
    ceiling = norm_ceiling(owner, of, m)
    if not math.isfinite(ceiling) or not all(math.isfinite(c.norm) for c in of.values()):
        return None  # a NaN or infinite contribution: the norm bound's and the commit's
    # A sum that is NaN or infinite is no evidence either: finite contributions may overflow
    # the part's dtype as they are added, or as a lossy codec encodes the sum.
    past = [j for j, c in sorted(of.items()) if math.isfinite(c.sum_norm) and c.sum_norm > ceiling]
    found = _witness(owner, past, hosts)
    if found is None:
        return None
    witness, by = found
    return (
        f"the sum it answered for its part has ‖S‖ = {of[witness].sum_norm!r}, {by}, past "
        f"{ceiling!r}, the most the norms it says it summed allow (Σ ‖x‖)"
    )


def _witness(owner: int, past: Sequence[int], hosts: Sequence[str]) -> tuple[int, str] | None:
    """Whose report of the sum convicts `owner`, and how it is said, given the contributors
    whose report of it is `past` what the owner says it summed: its own (its word against its
    word), or `ACCUSERS` others' of two hosts or more (one of them honest: two seats of one
    host, `hosts` by member, are one token holder's word, issue 64); None: no conviction."""
    others = [j for j in past if j != owner]
    if owner in past:
        return owner, "by its own report"
    if len(others) >= ACCUSERS and len({hosts[j] for j in others if j < len(hosts)}) > 1:
        return others[0], f"as {len(others)} other contributors took it back"
    return None
