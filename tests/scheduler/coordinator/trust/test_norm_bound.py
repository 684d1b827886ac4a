"""The norm bound's judgement (`scheduler.coordinator.trust.norm_bound`) and who a failed checksum
of a replica's part leaves out (`sum_checks.replicas_to_leave_out`), on reports made by hand; the
real rounds are tests/stage_server/averaging/test_hostile_owner.py's."""

from __future__ import annotations

import math

from scheduler.coordinator.groups import Aggregator, RoundGroup
from scheduler.coordinator.round_failure import LeftOut, RoundFailure
from scheduler.coordinator.trust.norm_bound import outliers
from scheduler.coordinator.trust.round_checks import NORM_BOUND
from scheduler.coordinator.trust.sum_checks import Checksums, replicas_to_leave_out
from swarm.proto import stage_pb2 as pb

GROUP = RoundGroup(("a", "b", "c"))


def _checks(
    norms: list[float], silent: int | None = None, said: list[float] | None = None
) -> dict[int, Checksums]:
    """Three replicas owning a part each; contributor j's squared norm in every part is
    `norms[j]`² / 3 (so its whole norm is `norms[j]`), as each owner reports it received, and
    as j says it sent (`said[j]` in place of `norms[j]` where given: its own word)."""
    m = len(norms)
    own = norms if said is None else said
    out = {}
    for k in range(m):
        norm = own[k] / math.sqrt(m)  # of what k sent each part
        reports = [pb.SumCheck(part=p, norm=norm) for p in range(m) if p != k]
        received = [] if k == silent else [n * n / m for n in norms]
        reports.append(pb.SumCheck(part=k, norm=norm, received=received))
        out[k] = Checksums(1, reports)
    return out


def test_a_contribution_far_past_the_others_is_refused_and_honest_spread_is_not() -> None:
    found, median = outliers(GROUP, _checks([1.0, 1.3, 1e4]), {0: 2, 1: 2, 2: 2}, 8.0)
    assert list(found) == [2]
    # its figures, and that a yardstick is no proof; the rule is named once, by its caller
    assert found[2].startswith("its contribution, 5e+03 per microbatch, is past 8 times"), found
    assert found[2].endswith(": a bound an honest gradient spike can pass too"), found
    assert "norm bound" not in found[2]
    # as `swarm status` and the job's history say it: the rule named once, by the caller
    said = RoundFailure("", [LeftOut(1, "c", [NORM_BOUND], found[2], stays=True)]).status(3)
    assert said.count("norm bound") == 1, said
    assert said.startswith("step 3: stage 1: c stays in its pool: its contribution"), said
    assert said.endswith("its microbatches are replayed on the others"), said
    said = RoundFailure("", [LeftOut(1, "c", [NORM_BOUND], found[2])]).status(3)  # again
    assert said.startswith("step 3: stage 1: c left out until it rejoins: its"), said
    assert median is not None and 0.4 < median < 0.7  # the honest ones', per microbatch
    # Per microbatch: a replica that took 6 microbatches sends a sum 6 times larger.
    found, _ = outliers(GROUP, _checks([1.0, 1.0, 6.0]), {0: 1, 1: 1, 2: 6}, 8.0)
    assert found == {}


def test_two_contributors_compare_with_each_other_and_the_large_one_goes() -> None:
    pair = RoundGroup(("a", "b"))
    found, _ = outliers(pair, _checks([1.0, 1e3]), {0: 1, 1: 1}, 8.0)
    assert list(found) == [1]


def test_one_that_took_every_microbatch_is_held_to_the_stage_s_last_round() -> None:
    took_all = {0: 0, 1: 0, 2: 8}
    assert outliers(GROUP, _checks([0.0, 0.0, 1e4]), took_all, 8.0)[0] == {}  # nothing to go by
    found, _ = outliers(GROUP, _checks([0.0, 0.0, 1e4]), took_all, 8.0, before=0.5)
    assert list(found) == [2], found
    said = "is past 64 (8²) times the median of its stage's last round that passed (0.5)"
    assert said in found[2], found
    found, _ = outliers(GROUP, _checks([0.0, 0.0, 200.0]), took_all, 8.0, before=0.5)
    assert found == {}  # 25 per microbatch: within 8² of 0.5 (a step apart: a looser yardstick)


def test_an_owner_that_reports_nothing_it_summed_is_refused() -> None:
    found, _ = outliers(GROUP, _checks([1.0, 1.0, 1.0], silent=1), {0: 1, 1: 1, 2: 1}, 8.0)
    assert list(found) == [1] and "reported nothing" in found[1]


def test_a_replica_owner_named_by_most_goes_alone_by_few_with_its_accusers() -> None:
    contributors = {0: 3}
    both = {0: {1: {0}, 2: {0}}}  # the two others name owner 0
    assert replicas_to_leave_out(both, contributors, {}) == {0: {0: {1, 2}}}
    one = {0: {2: {0}}}  # one of the two: a lie, or an owner that answered it apart
    assert replicas_to_leave_out(one, contributors, {}) == {0: {0: {2}, 2: {0}}}
    aggregator = {0: {0: {3}, 1: {3}, 2: {3}}}  # part 3 is an aggregator's: `Groups.blame`'s
    assert replicas_to_leave_out(aggregator, contributors, {}) == {}


def test_a_nan_or_infinite_contribution_beside_finite_ones_is_refused() -> None:
    """One replica's NaN or infinite contribution made every member's average NaN, and the
    commit failed the job (`NonFiniteStep`): one hostile replica (or one faulty device) ended
    another submitter's job. Beside finite ones it is the round's to refuse: that replica is
    left out, its microbatches replayed by the others."""
    for bad in (float("nan"), float("inf")):
        found, median = outliers(GROUP, _checks([1.0, bad, 1.3]), {0: 2, 1: 2, 2: 2}, 8.0)
        assert list(found) == [1], found
        assert "not finite" in found[1] and "the others' are" in found[1], found
        assert median is not None and math.isfinite(median)
    # One that took no microbatch sends zeros: a NaN from it is no honest gradient's either.
    found, _ = outliers(GROUP, _checks([1.0, 1.0, float("nan")]), {0: 1, 1: 1, 2: 0}, 8.0)
    assert list(found) == [2], found


def test_an_owners_word_alone_that_others_sent_nan_leaves_no_one_out() -> None:
    """A hostile owner reporting NaN for every other sender would leave the whole pool out in
    one round (a review found it): a contribution is refused as not finite only where its
    sender's own word says so too."""
    nan = float("nan")
    pool = RoundGroup(("a", "b", "c", "d"))
    checks = _checks([1.0, nan, nan, nan], said=[1.0, 1.1, 0.9, 1.2])
    found, _ = outliers(pool, checks, {0: 1, 1: 1, 2: 1, 3: 1}, 8.0)
    assert found == {}, found  # left to the commit, as before


def test_zeros_of_one_that_took_nothing_do_not_make_a_diverged_model_a_replicas_fault() -> None:
    """Every replica that took microbatches sent NaN: the model's, whatever the idle one's
    zeros say."""
    nan = float("nan")
    found, _ = outliers(GROUP, _checks([nan, nan, 0.0]), {0: 2, 1: 2, 2: 0}, 8.0)
    assert found == {}, found


def test_a_hostile_owners_negative_or_huge_report_fails_nothing() -> None:
    """A negative square raised in `math.sqrt`, a norm past 1.3e154 in `**`: one report failed
    the job as a bug. A negative square counts as none; a huge one's square is infinite, which
    the bound leaves to the commit (no one is refused on it; nothing raises)."""
    checks = _checks([1.0, 1.0, 1.0])
    checks[0].reports[-1].received[1] = -5.0
    assert outliers(GROUP, checks, {0: 1, 1: 1, 2: 1}, 8.0)[0] == {}
    aggregated = RoundGroup(("a", "b", "agg"), aggregators=(Aggregator("agg", "agg"),))
    checks = _checks([1.0, 1.0])
    checks[1].reports.append(pb.SumCheck(part=2, norm=1e200))  # its own word about it
    found, _ = outliers(aggregated, checks, {0: 1, 1: 1}, 8.0)
    assert found == {}, found


def test_an_owners_nan_word_alone_does_not_blind_the_bound_to_another() -> None:
    """A sender made NaN by an owner's word alone is no part of the medians: a liar of 1e4
    beside it is still refused (a review found the NaN median let it pass)."""
    nan = float("nan")
    checks = _checks([nan, 1.0, 1e4], said=[1.0, 1.0, 1e4])
    found, median = outliers(GROUP, checks, {0: 1, 1: 1, 2: 1}, 8.0)
    assert list(found) == [2], found
    assert median is not None and math.isfinite(median)


def test_every_contribution_nan_is_left_to_the_commit() -> None:
    """The model diverged (or the data): every contributor's is NaN, no one is to blame, and
    the commit fails the job with its cause (`NonFiniteStep`), as before."""
    nan = float("nan")
    found, _ = outliers(GROUP, _checks([nan, nan, nan]), {0: 1, 1: 1, 2: 1}, 8.0)
    assert found == {}
