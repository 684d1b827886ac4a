"""A contributor's word about what it sent, held to its owner's about what it received (issue 55;
docs/decisions.md, "Sum liars banned").

Each contributor j reports, for every part k, r·x_jk of what it sent there (`SumCheck.dot`),
under the round's seed r and each audit seed q it was given; and each replica owner reports,
of its own part, r·x_jk and Σ|r·x_jk| of every sender's values as it summed them
(`received_dots`, `received_magnitudes`: one more dot per element it sums,
`stage_server.averaging.checksum`). The two are dots of the same values with the same r, so an
honest pair agrees up to the dots' own rounding (`agree`). So:
- **The expected Σ_j r·x_j of a part is its owner's words** (`owner_words`), not each
  contributor's about itself: a member that lies about its own contribution no longer fails an
  honest owner's sum. A wrong r·S against them is the owner's alone (`sum_liars`: convicted by
  its own report, or by two other contributors').
- **A disagreement is one word against another** (`disagreements`): nothing signed the values
  on the wire, so it cannot tell the member that lies about what it sent from the owner that
  lies about what it received. As on the push plane (`client.audit.disputes`), a liar
  disagrees with every honest party it deals with and an honest one only with liars: the party
  in disagreement with two others or more is the liar (`liars`), and with at most one liar in a
  pool, framing an honest one takes two. A single disagreement convicts no one: the round
  fails, and in a pool of three or more both are left out (`judged`, as
  `sum_checks.replicas_to_leave_out` leaves out an owner and its lone accuser), their
  microbatches replayed.
- **A NaN is a word too.** A member whose word (its r·x) says it sent finite
  values where its owner says it summed a NaN or an infinity from it (or the other way round)
  disagrees with it, as over any other value; both saying so is no disagreement (the sender's
  own NaN: `norm_bound` refuses it, its dot among what it reads). The part's sum is then not held
  to the members' words (`sum_checks._owned`: an honest owner's is NaN, and one taken back
  finite names the owner): before, a member that sent one owner a NaN under finite words had
  every member's r·S name that honest owner, left out alone, then the next. In a pool of two
  the one other contributor is a majority: there the owner goes alone, as for any word, unless
  the other disagreed with another party in the steps before (`disputes_kept`: convicted).
- **The contributions' audit reads them too** (`contributions`): q·x_jk of an audited j's
  share of another's part is that owner's word, which no member's lie moves.
An owner that reports no words (an aggregator, or a replica that did not say them) leaves the
members' own words to stand, as before.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from scheduler.coordinator.groups import RoundGroup
from scheduler.coordinator.trust.sum_checks import (
    DOT_BLOCK,
    SIGMAS,
    Accusations,
    Checksums,
    encoding_allowed,
    said_words,
    verify,
)
from swarm.ops.totals import reported_sum
from swarm.proto import stage_pb2 as pb

__all__ = [
    "LIARS_AT",
    "Disagreement",
    "agree",
    "by_seed",
    "disagreements",
    "judged",
    "liars",
    "owner_tolerance",
]

_EPS64 = 2.0**-53
LIARS_AT = 2  # the fewest others a party disagrees with that make it the liar


def agree(said: float, said_magnitude: float, received: float, magnitude: float) -> bool:
    """Whether two dots of the same values with the same r agree: each is taken `DOT_BLOCK`
    products at a time, so rounds by at most DOT_BLOCK·2^-53 of its Σ|r·x|."""
    allowed = 4 * DOT_BLOCK * _EPS64 * max(said_magnitude, magnitude)
    return abs(said - received) <= allowed  # NaN disagrees


def owner_tolerance(
    of: Mapping[int, pb.SumCheck], owner: int, words: Sequence[tuple[float, float]], m: int
) -> float:
    """How far an honest r·S of `owner`'s part may be from Σ of its `words` (`sum_checks`'
    `tolerance`, each contribution's scales the owner's: `received`, `received_magnitudes`;
    `of`: every contributor's report of the part)."""
    squares = list(of[owner].received)
    if len(squares) == m:
        norms = reported_sum(math.sqrt(max(q, 0.0)) for q in squares)
    else:  # it said no norms: the norm bound refuses it (`norm_bound`)
        norms = reported_sum(c.norm for c in of.values())
    unit = max(c.unit for c in of.values())
    summing = SIGMAS * (m - 1) * unit * norms
    dotting = 2 * (m + 1) * DOT_BLOCK * _EPS64 * reported_sum(w[1] for w in words)
    return summing + dotting + SIGMAS * encoding_allowed(of.values(), norms)


@dataclass(frozen=True)
class Disagreement:
    """Contributor `member` says it sent part `owner` values of r·x = `said`; the owner says
    it received `received` (`seed`: "r", or which audit seed)."""

    member: int
    owner: int
    said: float
    received: float
    seed: str

    def line(self) -> str:
        return (
            f"its word about what it sent to part {self.owner} ({self.seed}·x = {self.said!r}) "
            f"is not its owner's about what it received ({self.received!r})"
        )


def by_seed(of: Mapping[int, Checksums]) -> dict[str, dict[int, list[pb.SumCheck]]]:
    """A round's reports of one stage (contributor -> its checksums) by seed: "r", the round's,
    then each audit seed's, from the members that were given it."""
    out = {"r": {j: list(c.reports) for j, c in of.items()}}
    seeds = sorted({s for c in of.values() for s in c.audit_seeds})
    for n, seed in enumerate(seeds):
        given = {j: c.audit_checks(seed) for j, c in of.items() if seed in c.audit_seeds}
        out[f"q{n}"] = given
    return out


def disagreements(
    seeds: Mapping[str, Mapping[int, Sequence[pb.SumCheck]]], m: int
) -> list[Disagreement]:
    """Every contributor's word about what it sent a replica's part that its owner's word about
    what it received contradicts, under each seed (`by_seed`)."""
    found = []
    for seed, reports in seeds.items():
        by_part: dict[int, dict[int, pb.SumCheck]] = {}
        for j, checks in reports.items():
            for check in checks:
                by_part.setdefault(check.part, {})[j] = check
        for part, of in sorted(by_part.items()):
            words = said_words(of, part, m)
            if words is None:
                continue
            for j, c in sorted(of.items()):
                if j == part or not 0 <= j < m:
                    continue
                received, magnitude = words[j]
                # Like with like: dots with dots. A norm (a sum of squares) or Σ|r·x| overflows
                # float64 where the dot does not (an honest diverging job's): no evidence.
                sent_finite = math.isfinite(c.dot)
                if sent_finite != math.isfinite(received):
                    # One says a NaN or an infinity went over, the other finite values: the
                    # sender's word against the owner's, as any other disagreement is.
                    found.append(Disagreement(j, part, c.dot, received, seed))
                elif not sent_finite or not math.isfinite(c.magnitude + magnitude):
                    continue  # both not finite (the sender's own NaN), or a scale overflowed
                elif not agree(c.dot, c.magnitude, received, magnitude):
                    found.append(Disagreement(j, part, c.dot, received, seed))
    return found


def liars(found: Sequence[Disagreement], hosts: Sequence[str] = ()) -> dict[int, str]:
    """The contributors whose words disagree with `LIARS_AT` others or more (a member with its
    owners, an owner with its members), those others seats of two hosts or more where `hosts`
    (by member: `swarm.net.seats`) says (issue 64: two seats of one host are one token holder's
    word): each with the evidence, in one line."""
    others: dict[int, set[int]] = {}
    for d in found:
        others.setdefault(d.member, set()).add(d.owner)
        others.setdefault(d.owner, set()).add(d.member)
    out = {}
    for party, against in sorted(others.items()):
        if len(against) < LIARS_AT:
            continue
        if len(hosts) > max(against) and len({hosts[j] for j in against}) < 2:
            continue  # its accusers are one host's seats
        mine = [d for d in found if party in (d.member, d.owner)]
        as_member = [d for d in mine if d.member == party]
        if len(as_member) * 2 >= len(mine):
            what = f"its words about what it sent disagree with {len(against)} owners'"
        else:
            what = f"its words about what it received disagree with {len(against)} members'"
        out[party] = f"{what} ({mine[0].line()})"
    return out


def judged(
    groups: Mapping[int, RoundGroup], checks: Mapping[int, Mapping[int, Checksums]]
) -> tuple[Accusations, list[str]]:
    """`sum_checks.verify`'s judgement of a round, each disagreement added: the member names
    the owner's part, as an accuser does (one line each)."""
    accusations, lines = verify(groups, checks)
    for stage, of in checks.items():
        group = groups[stage]
        m = len(group.members) - len(group.aggregators)
        for d in disagreements(by_seed(of), m):
            accusations.setdefault(stage, {}).setdefault(d.member, set()).add(d.owner)
            who = f"{group.members[d.member]} and {group.members[d.owner]}"
            lines.append(f"stage {stage}: {who} disagree: {d.line()}")
    return accusations, lines
