"""What the coordinator checks of the sums every part's owner answers (issue 43, item 4; a replica
owner's too, issue 55): a linear checksum (the contributor's side:
`stage_server.averaging.checksum`).

Each PREPARE of a round of two contributors or more carries a seed drawn anew for the attempt and
the stage (`Checksums`; a replica of one stage, colluding with an aggregator, learns nothing of
another stage's), sent to that stage's replicas only: an aggregator never sees it (it takes
`PoolService.Reduce` calls and nothing else). From it each contributor j draws one random vector
r and reports, for every part, c_j = r·x_j over what it contributed, a_j = Σ_i |r_i·x_ji|,
q_j = ‖x_j‖, s_j = r·S_j over the sum S_j it took back, and ‖S_j‖; a replica owner also reports
c_j and a_j of each sender's values as it summed them (`owner_words`), and the expected Σ_j c_j
is then its words, to which each member's c_j is held (`sent_words`): a member's lie about its
own contribution no longer fails the owner's sum. Summation is linear, so an honest S gives
s_j = Σ_j c_j up to rounding (`tolerance`):
- the owner's additions in the part's dtype leave S off the exact sum by a vector δ with
  |δ_i| ≤ (m - 1)·u·Σ_j |x_ji| (m contributors, u the dtype's unit roundoff), so
  ‖δ‖ ≤ (m - 1)·u·Σ_j q_j. δ does not depend on r (the owner never sees it), and the r_i are
  independent and uniform in [-1, 1), so |r·δ| passes t·‖δ‖ with a chance under 2·exp(-t²/2)
  (Hoeffding): it is held to t = `SIGMAS` (a false alarm about once in 10^21 checks). The worst
  case, Σ|r_i·δ_i|, would grow with the part's length n where this grows with √n, and hide
  errors √n times larger;
- the float64 dots, which do depend on r, are held to their worst case: each adds `DOT_BLOCK`
  products at a time, so it rounds by at most DOT_BLOCK·2^-53 of a_j (and r·S of Σ_j a_j).
A wrong sum S' passes only if r·(S' - S) falls inside that, which for r unknown to the owner is
a chance of about tolerance/‖S' - S‖: in float32, an error of about 1e-5 of an element's
magnitude spread over the part is caught, whatever its length. Every contributor's s_j is
checked, not one's: an owner could answer members different sums.

A replica owner knows r (it is a contributor of the stage), so it could answer S + e with
r·e = 0. The sum's norm closes most of that: ‖S‖ ≤ Σ_j ‖x_j‖, with the norms as the owner
itself reports it summed them (`norm_ceiling`; `SumCheck.received`), so e must hide within what
the contributions' norms leave, and an owner that inflates its own share is the norm bound's
(`norm_bound`). A contributor colluding with an aggregator of its stage can do as much for the
aggregator's part (docs/decisions.md, "Poison-proofing, the averaging side").

A mismatch fails the round before any APPLY (the replicas' prepared sums are replaced by the
retry's PREPARE), naming the owner: an aggregator sits out (`Groups.blame`), a replica is left
out and replayed (`replicas_to_leave_out`), or banned where its own words, or two others',
convict it (`sum_liars`). Lossy rounds are checked too, on the decoded values
every member uses, the sum's one encoding allowed for by the bound each contributor reports of
it (`encoding`: `stage_server.averaging.checksum`), never more than the worst codec's share of
the contributions' norms (`encoding_allowed`; issue 64: the bound is taken from the sum answered,
so a sum a million times too large once raised its own). A lossy round is also held to x·S
(`crossed`): with S' the sum taken back and Σ x the exact one,
‖S'‖² - 2·Σ_j x_j·S' = ‖S' - Σ x‖² - ‖Σ x‖², at most (k² - 1)·‖Σ x‖² for a codec that moves a
vector by k of its norm (k < 1: nothing but rounding). A sign-flipped sum gives 3·‖Σ x‖², a
scaled one about its scale squared, whatever r: caught where the r·S check's allowance for a
3-bit codec (ten times its error, as large as the sum) lets them pass. A part some contributor
did not report is not judged (a contributor is trusted as any member is: it could as well send a
wrong gradient; and its x·S, a word of its own, is held to no one's: a member that lies about it
has an honest owner of a lossy part left out, never banned: `sum_liars` does not read it).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from scheduler.coordinator.groups import RoundGroup
from swarm.net.seats import seat
from swarm.ops.totals import reported_sum
from swarm.proto import stage_pb2 as pb
from swarm.wire.hadamard import ERROR_SHARE

__all__ = [
    "DOT_BLOCK",
    "SIGMAS",
    "Checksums",
    "Mismatch",
    "checked",
    "crossed",
    "encoding_allowed",
    "group_hosts",
    "hosts_of",
    "mismatches",
    "new_seed",
    "nonfinite_senders",
    "norm_ceiling",
    "owner_words",
    "replicas_to_leave_out",
    "said_words",
    "tolerance",
    "verify",
]

# The most elements a contributor's float64 dot adds before its partial sums are added exactly
# (`stage_server.averaging.checksum.BLOCK`): its rounding is at most DOT_BLOCK·2^-53 of a_j.
DOT_BLOCK = 1 << 16
SIGMAS = 10.0  # how many times its rounding's bound ‖δ‖ an honest r·δ may reach
_EPS64 = 2.0**-53


def new_seed() -> int:
    """A fresh secret seed for one attempt's checksums (never 0, which asks none)."""
    return secrets.randbits(63) or 1


@dataclass
class Checksums:
    """One replica's checksums of one PREPARE: the `seed` it is sent, and what it answered
    (`reports`: one `SumCheck` per aggregator's part it averaged; filled in with its answer)."""

    seed: int
    reports: list[pb.SumCheck] = field(default_factory=list)
    # other contributors' contributions audited (`contributions`): the same, a seed each
    audit_seeds: tuple[int, ...] = ()
    audit_reports: list[pb.SumCheck] = field(default_factory=list)

    def audit_checks(self, seed: int) -> list[pb.SumCheck]:
        """Its reports of the audit seed `seed` (none if it was not sent that one)."""
        if seed not in self.audit_seeds:
            return []
        index = self.audit_seeds.index(seed)
        return [c for c in self.audit_reports if c.seed_index == index]


def checked(group: RoundGroup, seed: int) -> Checksums | None:
    """A contributor's checksums to ask for in a round of `group`: in every round of two
    contributors or more (every part is checked, a replica's as an aggregator's: issue 55)."""
    return Checksums(seed) if len(group.members) - len(group.aggregators) >= 2 else None


@dataclass(frozen=True)
class Mismatch:
    """Contributor `contributor`'s sum of part `part` (a group index: its aggregator) is not
    what the contributions add up to."""

    part: int
    contributor: int
    got: float  # its r·S (or its ‖S‖)
    expected: float  # Σ_j r·x_j (or the most ‖S‖ may be: `norm_ceiling`)
    tolerance: float
    # which check it fails: "r·S", "‖S‖", "x·S"; its owner's own words: "own x", "finite S"
    what: str = "r·S"


def tolerance(reports: Sequence[pb.SumCheck], contributors: int) -> float:
    """How far an honest r·S may be from Σ_j r·x_j, given every contributor's report of a part."""
    m = max(contributors, 1)
    unit = max((r.unit for r in reports), default=0.0)
    summing = SIGMAS * (m - 1) * unit * reported_sum(r.norm for r in reports)
    # Each c_j's dot, and s_j's (|S_i| ≤ Σ_j |x_ji| to within the rounding): twice, for the
    # products' own rounding and what the bound leaves out.
    dotting = 2 * (m + 1) * DOT_BLOCK * _EPS64 * reported_sum(r.magnitude for r in reports)
    # A lossy codec's one encoding of the sum, δ' (bounded by each contributor from the decoded
    # sum, `encoding`, and by the contributions' norms): independent of r as δ is, so held to
    # SIGMAS of its norm as well.
    norms = reported_sum(r.norm for r in reports)
    return summing + dotting + SIGMAS * encoding_allowed(reports, norms)


def encoding_allowed(reports: Iterable[pb.SumCheck], norms: float) -> float:
    """The most a lossy sum's one encoding is allowed to have moved it: the largest bound a
    contributor reports (`encoding`, taken from the decoded sum: an owner's answer), never past
    the worst codec's share of `norms`, the contributions' Σ ‖x‖ (‖Σ x‖ ≤ Σ ‖x‖; issue 64)."""
    reported = max((r.encoding for r in reports), default=0.0)
    if not reported > 0:  # NaN asks none either
        return 0.0
    return min(reported, 1.01 * ERROR_SHARE * norms)


def said_words(
    of: Mapping[int, pb.SumCheck], part: int, m: int
) -> list[tuple[float, float]] | None:
    """Replica `part`'s words about what each of the `m` contributors sent its part, in sender
    order: (r·x, Σ|r·x|) each, NaN or infinite ones included; None where it said none."""
    own = of.get(part)
    if own is None or part >= m:
        return None
    if len(own.received_dots) != m or len(own.received_magnitudes) != m:
        return None  # checked before copying: a report's lists are sized by its sender
    return list(zip(own.received_dots, own.received_magnitudes, strict=True))


def owner_words(
    of: Mapping[int, pb.SumCheck], part: int, m: int
) -> list[tuple[float, float]] | None:
    """Replica `part`'s words about what each of the `m` contributors sent its part, in sender
    order: (r·x, Σ|r·x|) each; None where it said none, or some not finite."""
    words = said_words(of, part, m)
    if words is None or not all(math.isfinite(d + a) for d, a in words):
        return None
    return words


def nonfinite_senders(of: Mapping[int, pb.SumCheck], part: int, m: int) -> list[int]:
    """The contributors replica `part` says sent its part a NaN or an infinity (its words of
    what it summed: `said_words`). Its sum is then NaN by what it summed, whatever the senders
    say they sent: one that says otherwise is in disagreement with it (`sent_words`)."""
    words = said_words(of, part, m) or []
    # The dot alone: a NaN or an infinity makes it one (r_i·inf is one, r_i = 0 too), while
    # Σ|r·x| may overflow for finite values (an honest float64 step past 1e302 an element).
    return [j for j, (dot, _) in enumerate(words) if not math.isfinite(dot)]


def mismatches(reports: Mapping[int, Sequence[pb.SumCheck]], contributors: int) -> list[Mismatch]:
    """The sums that fail their checksum, given each contributor's reports (contributor index ->
    its `SumCheck`s) of one round of `contributors`. A part is judged only when every contributor
    reported it, with finite contributions (a NaN or infinite gradient is the norm bound's and
    the commit's: `nonfinite`); a NaN or infinite sum of finite contributions is a mismatch.
    Where the owner says a sender sent it a NaN or an infinity, or contradicts its own report of
    its own contribution, its sum is not held to the senders' words (`_owned`)."""
    if len(reports) < contributors or contributors < 2:
        return []
    by_part: dict[int, dict[int, pb.SumCheck]] = {}
    for j, checks in reports.items():
        for check in checks:
            by_part.setdefault(check.part, {})[j] = check
    found = []
    for part, of in sorted(by_part.items()):
        if len(of) < contributors:
            continue
        checks = list(of.values())
        owned = _owned(of, part, contributors)
        if owned is not None:
            found += owned  # what its owner says of it, against itself
            continue
        if not all(math.isfinite(c.dot) for c in checks):
            # A sender's own NaN, where its owner said no words: the norm bound's. The part's
            # honest sum is then NaN too: one taken back finite names its owner (a forgery a NaN
            # of the owner's own report, and no words, let pass every check).
            found += _finite_sums(of)
            continue
        if not all(math.isfinite(c.norm) for c in checks):
            # Squares past float64, dots finite (an honest Σ|r·x| overflows only after them):
            # no tolerance to hold r·S to.
            continue
        # The owner's words about what each sent it, where it said them: a member's word
        # about its own contribution is held to them (`sent_words`), never summed here.
        words = owner_words(of, part, contributors)
        if words is None:
            expected = reported_sum(c.dot for c in checks)
        else:
            expected = reported_sum(w[0] for w in words)
            squares = list(of[part].received)
            norms = [math.sqrt(max(q, 0.0)) for q in squares] if len(squares) == len(words) else []
            checks = [_scaled(c, words[j], norms[j] if norms else 0.0) for j, c in of.items()]
        allowed = tolerance(checks, contributors)
        most = norm_ceiling(part, of, contributors)
        for j, c in sorted(of.items()):
            if not abs(c.sum_dot - expected) <= allowed:  # NaN fails too
                found.append(Mismatch(part, j, c.sum_dot, expected, allowed))
            elif not c.sum_norm <= most:  # a sum larger than its contributions allow
                found.append(Mismatch(part, j, c.sum_norm, most, 0.0, "‖S‖"))
        found += crossed(part, of, contributors)
    return found


def _owned(of: Mapping[int, pb.SumCheck], part: int, contributors: int) -> list[Mismatch] | None:
    """Where replica `part`'s words say a NaN or an infinity went into its part, or where its
    own report of its own contribution says one did, against its word: the part's mismatches
    (each naming the owner), and its sum is not held to anyone's finite words. None: its words
    are finite and its own report agrees, judged as any part is.

    - Its own report of its contribution and its word of it, one finite and one not, or its
      dots of a sender's values not finite where its square of them is: it contradicts itself,
      and every other contributor names it ("own x"). Else a hostile owner could name itself
      (or report its own dot NaN) and answer a sum no finite word held, or say its own NaN with
      a finite square and pass the norm bound with it.
    - Its words name a sender (`nonfinite_senders`): an honest owner's sum is then NaN, so a
      sum taken back finite contradicts its own word, and each contributor that took one back
      names it ("finite S"). Who sent the NaN is the sender's word against the owner's
      (`sent_words`); before, the senders' finite words were the part's expected sum, and a
      member that sent one owner a NaN under finite words had that honest owner left out,
      then the next."""
    words, own = said_words(of, part, contributors), of.get(part)
    if words is None or own is None:
        return None
    named = nonfinite_senders(of, part, contributors)
    squares = list(own.received)
    # Its square of a sender's values finite where its dots of them are not: no values give that
    # (a square overflows before a dot does, never after), so its words contradict themselves.
    squared = [j for j in named if len(squares) == contributors and math.isfinite(squares[j])]
    said_own = math.isfinite(own.dot)  # dots with dots (a norm, or Σ|r·x|, overflows first)
    if squared or said_own != math.isfinite(words[part][0]):
        return [Mismatch(part, j, math.nan, own.dot, 0.0, "own x") for j in sorted(of) if j != part]
    return _finite_sums(of) if named else None


def _finite_sums(of: Mapping[int, pb.SumCheck]) -> list[Mismatch]:
    """Where a NaN or an infinity went into a part, by someone's word: each contributor that
    took its sum back finite names the owner ("finite S": no honest sum of it is)."""
    return [
        Mismatch(c.part, j, c.sum_dot, math.nan, 0.0, "finite S")
        for j, c in sorted(of.items())
        if math.isfinite(c.sum_dot)  # r·S of a sum holding a NaN or an infinity is not
    ]


def crossed(part: int, of: Mapping[int, pb.SumCheck], contributors: int) -> list[Mismatch]:
    """A lossy part's sums past what x·S allows (the module's docstring): each contributor's
    ‖S'‖² - 2·Σ_j x_j·S' against (k² - 1)·N² and the roundings, N the contributions' Σ ‖x‖,
    k the share of its norm the codec moves a sum by (as the contributors report it, never past
    `ERROR_SHARE`). Judged only where every contributor reported a lossy sum (`encoding`) and a
    finite x·S; a mismatch names the owner, as a failed r·S does."""
    checks = list(of.values())
    if not all(c.encoding > 0 and math.isfinite(c.sum_cross + c.sum_norm) for c in checks):
        return []  # lossless, or a contribution not seen whole: nothing to judge
    norms = _norms(part, of, contributors)
    total = reported_sum(norms)
    shares = [min(c.encoding / c.sum_norm, ERROR_SHARE) if c.sum_norm > 0 else 0.0 for c in checks]
    k = 1.01 * max(shares)
    unit = max(c.unit for c in checks)
    # The owner's additions move the exact sum by at most (m - 1)·u·N, before and after its
    # encoding: d. Then ‖S' - Σ x‖ ≤ k·‖Σ x‖ + d, so the statistic ≤ (k² - 1)·N² + 2k·N·d + d².
    d = (1 + k) * (contributors - 1) * unit * total
    allowed = max(k * k - 1, 0.0) * total * total + 2 * k * total * d + d * d
    found = []
    crosses = reported_sum(c.sum_cross for c in checks)
    for j, c in sorted(of.items()):
        # Each float64 dot, a block at a time: x_j·S' and ‖S'‖² round by BLOCK·2^-53 of
        # ‖x_j‖·‖S'‖ and ‖S'‖², twice over for what the bound leaves out.
        squared = c.sum_norm * c.sum_norm  # inf past 1.3e154, where ** raised
        dotting = 4 * DOT_BLOCK * _EPS64 * (2 * total * c.sum_norm + squared)
        statistic = squared - 2 * crosses
        if not statistic <= allowed + dotting:
            found.append(Mismatch(part, j, statistic, allowed, dotting, "x·S"))
    return found


def _norms(part: int, of: Mapping[int, pb.SumCheck], contributors: int) -> list[float]:
    """The contributions' norms of `part`, as its owner reports it summed them
    (`SumCheck.received`, a replica owner's), else as each contributor reports its own."""
    owner = of.get(part)
    received = list(owner.received) if owner is not None else []
    if len(received) == contributors:
        return [math.sqrt(max(q, 0.0)) for q in received]
    return [c.norm for c in of.values()]


def _scaled(check: pb.SumCheck, word: tuple[float, float], norm: float) -> pb.SumCheck:
    """`check` with the larger of its own Σ|r·x| and ‖x‖ and its owner's words of them (`word`,
    `norm`): the tolerance may be shrunk by neither, nor made NaN by a member's NaN scale (its
    dot finite: a lie, or its owner's words would have named it) where its owner's is finite."""
    out = pb.SumCheck()
    out.CopyFrom(check)
    out.magnitude = _larger(check.magnitude, word[1])
    out.norm = _larger(check.norm, norm)
    return out


def _larger(own: float, owners: float) -> float:
    """The larger of a member's word and its owner's, the owner's where the member's is NaN."""
    return owners if math.isnan(own) else max(own, owners)


def norm_ceiling(part: int, of: Mapping[int, pb.SumCheck], contributors: int) -> float:
    """The most ‖S‖ of `part` may be: ‖Σ_j x_j‖ ≤ Σ_j ‖x_j‖, the norms as the owner reports it
    summed them (`SumCheck.received`, a replica owner's; else each contributor's own), with
    the owner's additions' rounding and a lossy codec's encoding of the sum allowed for. It
    holds an owner who knows r: a forgery e with r·e = 0 passes the linear checksum, but not
    this, unless it is smaller than what the contributions' norms leave (whose owner's own
    share the norm bound holds to the others': `norm_bound`)."""
    unit = max((c.unit for c in of.values()), default=0.0)
    total = reported_sum(_norms(part, of, contributors))
    rounding = (2 * contributors * (unit + _EPS64) + 1e-12) * total
    return total + rounding + 1.01 * encoding_allowed(of.values(), total)


Accusations = dict[int, dict[int, set[int]]]  # stage -> contributor -> the parts it names


def verify(
    groups: Mapping[int, RoundGroup], checks: Mapping[int, Mapping[int, Checksums]]
) -> tuple[Accusations, list[str]]:
    """A round's checksums (`checks`: stage -> contributor -> what it answered) judged: whom
    each contributor's failed checksums name, by stage (as an aborted member names whom it
    failed on: for `Groups.blame`), and one line each for the round's reason."""
    accusations: Accusations = {}
    lines = []
    for stage, of in checks.items():
        group = groups[stage]
        for bad in mismatches({j: c.reports for j, c in of.items()}, len(of)):
            accusations.setdefault(stage, {}).setdefault(bad.contributor, set()).add(bad.part)
            owner, at = group.members[bad.part], group.members[bad.contributor]
            kind = "aggregator" if bad.part >= len(of) else "replica"
            if bad.what == "r·S":
                said = f"r·S = {bad.got!r}, the contributions' Σ r·x = {bad.expected!r}, within "
                said += f"{bad.tolerance:.3g}"
            elif bad.what == "own x":
                said = "its owner's words of what it summed contradict themselves or its own "
                said += f"report of its contribution (r·x = {bad.expected!r}): a NaN or an "
                said += "infinity beside finite values"
            elif bad.what == "finite S":
                said = "its owner says it summed a NaN or an infinity, and the sum taken back "
                said += f"is finite (r·S = {bad.got!r})"
            elif bad.what == "x·S":
                said = (
                    f"‖S‖² - 2·Σ x·S = {bad.got!r}, past what the codec allows ({bad.expected!r})"
                )
            else:
                said = f"‖S‖ = {bad.got!r}, past the contributions' Σ ‖x‖ = {bad.expected!r}"
            lines.append(
                f"stage {stage}: the sum of part {bad.part} from {kind} {owner} fails its "
                f"checksum at {at} ({said})"
            )
    return accusations, lines


def hosts_of(group: RoundGroup) -> list[str]:
    """The host each member of a round's group is on (`swarm.net.seats`): two seats of one
    public host are one token holder's word (issue 64)."""
    return [seat(a, a) for a in group.members]


def group_hosts(groups: Mapping[int, RoundGroup]) -> dict[int, list[str]]:
    """Per stage, `hosts_of` its round's group."""
    return {stage: hosts_of(group) for stage, group in groups.items()}


def replicas_to_leave_out(
    accusations: Accusations,
    contributors: Mapping[int, int],
    hosts: Mapping[int, Sequence[str]],
) -> Accusations:
    """The replicas (stage -> group index -> who named it) a round's failed checksums leave out
    (`contributors`: per stage, how many of its group's first members contribute; a part past
    them is an aggregator's, which `Groups.blame` has sit out). A replica owner's wrong sum
    fails at every honest contributor: named by most of the other contributors, the owner alone
    is left out. Named by fewer, either it answered those few a different sum or they lie about
    it, which no one else can tell apart: the owner and its accusers are left out together, so
    a liar, owner or accuser, never removes an honest member without going itself. "Most" is
    counted by host (`hosts`: per stage, by member, `group_hosts`; a member without one is a
    host of its own): two seats of one host are one accuser, or a token holder with two peer
    ids in a pool of four would leave an honest owner out alone."""
    out: Accusations = {}
    for stage, accused in accusations.items():
        m = contributors.get(stage, 0)
        seats = list(hosts.get(stage, ()))
        host = [seats[j] if j < len(seats) else f"member {j}" for j in range(m)]
        for part in sorted({p for parts in accused.values() for p in parts}):
            if part >= m:
                continue  # an aggregator's
            by = {j for j, parts in accused.items() if part in parts and j != part}
            named = out.setdefault(stage, {})
            named.setdefault(part, set()).update(by)
            others = {host[j] for j in range(m) if j != part}
            if 2 * len({host[j] for j in by if j < m}) <= len(others):  # a minority: they go too
                for j in by:
                    named.setdefault(j, set()).add(part)
    return out
