"""Which replica owners a round's sum checks convict (`scheduler.coordinator.trust.sum_liars`):
banned only on evidence no single other member can make, on reports made by hand; the real rounds
are tests/stage_server/averaging/test_hostile_owner.py's and
tests/system/test_poison_rounds.py's."""

from __future__ import annotations

import math

import pytest

from scheduler.coordinator.groups import Aggregator, Link, RoundGroup
from scheduler.coordinator.trust.sum_checks import (
    Checksums,
    group_hosts,
    replicas_to_leave_out,
    verify,
)
from scheduler.coordinator.trust.sum_liars import convicted
from swarm.proto import stage_pb2 as pb

GROUP = RoundGroup(("a", "b", "c"))
HONEST = 2.0  # the norm of an honest sum of three contributions of norm 1 (ceiling: 3)


def _checks(
    sums: dict[int, float] | None = None,
    dots: dict[int, float] | None = None,
    received: bool = True,
    m: int = 3,
) -> dict[int, Checksums]:
    """`m` replicas owning a part each and contributing 1.0 (r·x) of norm 1 to each; part 0's
    sum as contributor j took it back has norm `sums[j]` (else `HONEST`) and r·S = m (the honest
    sum's); contributor j reports r·x = `dots[j]` to part 0 (else 1.0). The owners report what
    they summed (`received`: norm 1 from each) unless `received` is False for part 0's."""
    sums, dots = sums or {}, dots or {}
    out = {}
    for j in range(m):
        reports = []
        for k in range(m):
            check = pb.SumCheck(part=k, dot=1.0, magnitude=1.0, norm=1.0, sum_dot=float(m))
            check.sum_norm = sums.get(j, HONEST) if k == 0 else HONEST
            if k == 0:
                check.dot = dots.get(j, 1.0)
            if k == j and (received or k != 0):
                check.received.extend([1.0] * m)
            reports.append(check)
        out[j] = Checksums(1, reports)
    return out


def test_honest_sums_convict_no_one() -> None:
    assert convicted({0: GROUP}, {0: _checks()}) == {}
    assert verify({0: GROUP}, {0: _checks()}) == ({}, [])


def test_an_owner_whose_sum_is_past_its_own_norms_is_convicted_by_its_own_word() -> None:
    found = convicted({0: GROUP}, {0: _checks(sums={0: 1e4, 1: 1e4, 2: 1e4})})
    assert list(found) == [0] and list(found[0]) == [0]
    assert "by its own report" in found[0][0]
    # Its own report alone is enough: nobody else's word is in it.
    assert list(convicted({0: GROUP}, {0: _checks(sums={0: 1e4})})[0]) == [0]


def test_an_owner_that_reports_its_own_sum_honestly_is_convicted_by_two_others() -> None:
    found = convicted({0: GROUP}, {0: _checks(sums={1: 1e4, 2: 1e4})})
    assert list(found[0]) == [0] and "2 other contributors" in found[0][0]


def test_one_member_lying_about_the_sum_it_took_back_convicts_no_one() -> None:
    """It may say what it likes of its own sum: one accuser is one word against the owner's."""
    assert convicted({0: GROUP}, {0: _checks(sums={1: 1e4})}) == {}
    pair = RoundGroup(("a", "b"))
    assert convicted({0: pair}, {0: _checks(sums={1: 1e4}, m=2)}) == {}


def test_a_member_lying_about_its_own_contribution_frames_no_one() -> None:
    """Where the owner says nothing of what each sender sent it (no `received_dots`; its words
    are test_sent_words.py's), a member that reports a wrong r·x for part 0 makes every
    contributor's r·S fail, the owner's own included: the owner is named by all and left out,
    as an owner that answered everyone one wrong sum would be, which nobody can tell apart. It
    is never convicted."""
    framed = _checks(dots={2: 1.0 + 1e3})
    accusations, lines = verify({0: GROUP}, {0: framed})
    assert accusations == {0: {0: {0}, 1: {0}, 2: {0}}} and len(lines) == 3
    assert replicas_to_leave_out(accusations, {0: 3}, {}) == {0: {0: {1, 2}}}  # left out, alone
    assert convicted({0: GROUP}, {0: framed}) == {}


def test_no_conviction_when_the_owner_did_not_say_what_it_summed() -> None:
    """The ceiling would then be made of the members' own norms, which a liar could lower."""
    assert convicted({0: GROUP}, {0: _checks(sums={1: 1e4, 2: 1e4}, received=False)}) == {}


def test_an_aggregator_s_part_convicts_no_replica() -> None:
    aggregator = Aggregator("g", "agg:1", Link(1.0))
    with_aggregator = RoundGroup(("a", "b", "c", "agg:1"), aggregators=(aggregator,))
    checks = _checks()
    for c in checks.values():
        c.reports.append(pb.SumCheck(part=3, dot=1.0, norm=1.0, sum_dot=3.0, sum_norm=1e4))
    assert convicted({0: with_aggregator}, {0: checks}) == {}


def test_a_non_finite_sum_or_contribution_convicts_no_one() -> None:
    """Finite contributions may overflow as they are added (a float16 part), and a NaN or
    infinite gradient is the commit's to refuse: neither is evidence of a lie."""
    assert convicted({0: GROUP}, {0: _checks(sums={0: math.inf, 1: math.inf, 2: math.nan})}) == {}
    checks = _checks(sums={0: 1e4})
    checks[1].reports[0].norm = math.inf
    assert convicted({0: GROUP}, {0: checks}) == {}


@pytest.mark.attack("64-seats")
def test_two_accusers_of_one_host_convict_no_one() -> None:
    """Issue 64, item 4: two ids of one token holder in a pool of three each report a sum of
    the honest third's part past its norms: two others' words convicted it. Seats of one public
    host are one word; two hosts' still convict."""
    sybils = RoundGroup(("1.2.3.4:7000", "5.6.7.8:7000", "5.6.7.8:7001"))
    framed = _checks(sums={1: 1e4, 2: 1e4})
    assert convicted({0: sybils}, {0: framed}) == {}
    two_hosts = RoundGroup(("1.2.3.4:7000", "5.6.7.8:7000", "9.10.11.12:7000"))
    assert list(convicted({0: two_hosts}, {0: framed})[0]) == [0]


def test_two_seats_of_one_host_are_one_accuser_of_an_owner() -> None:
    """A pool of four: two members are seats of one public host (one token holder's two peer
    ids) and say the honest owner's sum they took back is wrong. By members they are most of the
    three others; by hosts they are one of two, one word against the owner's: the owner and
    both seats are left out (before, the owner alone, and the two seats stayed)."""
    group = RoundGroup(("9.9.9.9:5000", "1.2.3.4:5001", "1.2.3.4:5002", "8.8.8.8:5000"))
    framed = _checks(sums={1: 1e4, 2: 1e4}, m=4)
    accusations, _ = verify({0: group}, {0: framed})
    assert accusations == {0: {1: {0}, 2: {0}}}
    assert convicted({0: group}, {0: framed}) == {}  # two accusers, one host: no conviction
    out = replicas_to_leave_out(accusations, {0: 4}, group_hosts({0: group}))
    assert out == {0: {0: {1, 2}, 1: {0}, 2: {0}}}
    # Of three hosts, the same two accusers are two hosts of three: the owner alone
    apart = RoundGroup(("9.9.9.9:5000", "1.2.3.4:5001", "5.6.7.8:5002", "8.8.8.8:5000"))
    out = replicas_to_leave_out(accusations, {0: 4}, group_hosts({0: apart}))
    assert out == {0: {0: {1, 2}}}
