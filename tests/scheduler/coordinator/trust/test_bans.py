"""`scheduler.coordinator.trust.bans`: a verdict bans once and rolls back to the banned peer's first
step; a result resting on a banned peer's answer is not counted, its holders are voided and its
lease goes out again; every result's audit price is counted."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from scheduler.coordinator.ledger import StepLedger
from scheduler.coordinator.metrics import CoordinatorMetrics
from scheduler.coordinator.trust.bans import Bans, RollBack, doubt_window
from scheduler.coordinator.trust.standing import Ban, BanBook, Standing
from scheduler.store import JobStore
from scheduler.stored_bans import StoredBans
from swarm.job.config import JobConfig
from swarm.rpc.lease import MicrobatchResult, Replica, Verdict
from tests.support.jobs import make_job


def _bans(
    job: JobConfig | None = None, book: BanBook | None = None
) -> tuple[Bans, list[int], list[tuple[int, int, str]], list[str]]:
    said: list[str] = []
    rolled: list[int] = []
    voided: list[tuple[int, int, str]] = []

    async def void(ledger: StepLedger, stage: int, peer: str) -> None:
        voided.append((ledger.step, stage, peer))

    bans = Bans(
        Standing("job", book),
        CoordinatorMetrics("job", CollectorRegistry()),
        roll_back_to=rolled.append,
        void=void,
        on_ban=lambda ban: said.append(ban.text),
        job=job,
    )
    return bans, rolled, voided, said


async def _no_void(ledger: StepLedger, stage: int, peer: str) -> None:
    raise AssertionError("nothing is voided here")


def _kept(book: BanBook, rolled: RollBack) -> Bans:
    """Bans started from `book`, rolling back into `rolled`, with no job and nobody told."""
    metrics = CoordinatorMetrics("job", CollectorRegistry())
    return Bans(Standing("job", book), metrics, roll_back_to=rolled, void=_no_void)


def _result(step: int, index: int, *, touched: tuple[str, ...], **kw: object) -> MicrobatchResult:
    return MicrobatchResult(step, index, {0: "a", 1: "b"}, 1.0, 4, touched=touched, **kw)  # type: ignore[arg-type]


async def test_a_verdict_bans_once_and_rolls_back_to_the_liars_first_step() -> None:
    bans, rolled, voided, said = _bans()
    bans.saw([[Replica("a", "a:1")], [Replica("b", "b:1")]], 2)  # a coordinator started at 2
    bans.saw([[Replica("a", "a:1")], [Replica("b", "b:1"), Replica("liar", "l:1")]], 5)
    assert bans.first_seen == {"a": 0, "b": 0, "liar": 5}  # those at its start: from step 0
    members = bans.standing.members(lambda: [[Replica("a", "a:1")], [Replica("liar", "l:1")]])
    verdict = Verdict("liar", 1, "its outputs differ")
    ledger = StepLedger(step=7, microbatches=4, stages=2, microbatch_size=4)
    result = _result(7, 0, touched=("a", "liar"), verdicts=(verdict,), stage_runs=2, audit_runs=2)
    assert len(ledger.lease("t", 4)) == 4 and ledger.leasable() == 0
    assert await bans.screen("t", result, ledger)  # not counted: it rests on the liar
    assert ledger.leasable() == 1  # its lease given back: it goes out again at once
    assert rolled == [5]  # the first step it was a member at
    assert list(bans.banned) == ["liar"] and bans.caught_at == {"liar": 7}
    assert members() == [[Replica("a", "a:1")], []]
    assert voided == [(7, 0, "a"), (7, 1, "b")]
    assert len(said) == 1 and said[0].startswith("banned liar (stage 1)")
    assert bans.metrics.bans._value.get() == 1
    # again: no second ban, no second rollback; still not counted
    assert await bans.screen("t", _result(7, 1, touched=("liar",), verdicts=(verdict,)), ledger)
    assert rolled == [5] and bans.metrics.bans._value.get() == 1
    assert bans.metrics.stage_runs._value.get() == 2
    assert bans.metrics.audit_runs._value.get() == 2


async def test_a_liar_caught_before_any_lease_saw_it_is_recorded_from_the_step_it_was_caught() -> (
    None
):
    """A replica admitted as a step opened, after that step's leases went out, and caught lying
    as an auditor (so no result's path touched it either): its first step is the one it was
    caught at, recorded with the ban (tests/test_audits.py reads it)."""
    bans, rolled, _, _ = _bans()
    bans.saw([[Replica("a", "a:1")], [Replica("b", "b:1")]], 0)
    verdict = Verdict("liar", 1, "it re-executed outputs that differ")
    ledger = StepLedger(step=4, microbatches=4, stages=2, microbatch_size=4)
    assert not await bans.screen(
        "t", _result(4, 0, touched=("a", "b"), verdicts=(verdict,)), ledger
    )
    assert rolled == [4] and list(bans.banned) == ["liar"]
    assert bans.first_seen["liar"] == 4


async def test_a_result_that_does_not_rest_on_a_banned_peer_counts() -> None:
    bans, rolled, voided, _ = _bans()
    bans.banned["liar"] = "evidence"
    ledger = StepLedger(step=3, microbatches=4, stages=2, microbatch_size=4)
    assert not await bans.screen("t", _result(3, 0, touched=("a", "b")), ledger)
    assert not await bans.screen("t", _result(3, 1, touched=()), ledger)  # push: not known
    assert rolled == [] and voided == []


async def test_a_straggler_of_another_step_is_dropped_without_voids() -> None:
    bans, _, voided, _ = _bans()
    bans.banned["liar"] = "evidence"
    ledger = StepLedger(step=3, microbatches=4, stages=2, microbatch_size=4)
    assert await bans.screen("t", _result(2, 0, touched=("liar",)), ledger)
    assert await bans.screen("t", _result(3, 0, touched=("liar",)), None)
    assert voided == []


class _Book:
    """A `BanBook` in memory; `order` says when each ban was kept, among the rollbacks."""

    binds_credentials = False

    def __init__(self, kept: list[Ban], order: list[object]) -> None:
        self.bans, self.order = kept, order

    def kept(self) -> list[Ban]:
        return list(self.bans)

    def keep(self, ban: Ban) -> None:
        self.bans.append(ban)
        self.order.append(ban)

    def seen(self) -> dict[str, int]:
        return {}

    def see(self, peer: str, step: int) -> None:
        pass


async def test_kept_bans_hold_from_the_start_and_a_new_one_is_kept_before_its_rollback() -> None:
    order: list[object] = []
    kept = [
        Ban("old", 0, 3, 1, "its outputs differ", replayed=True),
        Ban("cut-short", 1, 6, 4, "its sums differ"),  # the scheduler stopped before its rollback
    ]
    book = _Book(kept, order)
    bans = _kept(book, order.append)
    assert bans.banned == {"old": "its outputs differ", "cut-short": "its sums differ"}
    members = bans.standing.members(lambda: [[Replica("old", "o:1"), Replica("a", "a:1")], []])
    assert members() == [[Replica("a", "a:1")], []]
    assert order == []  # nothing until this coordinator leases
    bans.saw([[Replica("a", "a:1")]], 8)
    assert order == [4]  # the rollback it never had; the replayed one's is not run again
    bans.saw([[Replica("a", "a:1")]], 9)
    assert order == [4]
    await bans.ban("a", 0, "it lied", 9)
    assert order == [4, Ban("a", 0, 9, 0, "it lied"), 0]  # kept, then rolled back
    assert bans.metrics.bans._value.get() == 1  # the kept ones are not banned anew


def _audited(tmp_path: Path, fraction: float) -> JobConfig:
    """A job of 2 stages, 8 microbatches a step, its answers audited at `fraction`."""
    training = {"stages": 2, "target_batch_size": 8, "microbatch_size": 1}
    return make_job(tmp_path, training=training, trust={"audit_fraction": fraction})


@pytest.mark.attack("64-depth")
@pytest.mark.parametrize("restarted", [False, True])
async def test_a_liar_honest_for_k_steps_rolls_back_only_its_doubt_window(
    tmp_path: Path, restarted: bool
) -> None:
    """Issue 64, item 3: a ban rolled the job back to the liar's `first_seen`, 0 for a peer
    present when a coordinator started: a peer honest for 40 steps that lied once erased 40
    steps (after a scheduler restart, the whole job), and came back under a new id to do it
    again. The rollback goes no deeper than the steps the audits leave a steady liar unseen:
    one step when every answer is audited."""
    job = _audited(tmp_path, 1.0)
    assert job.training.microbatches_per_step == 8
    bans, rolled, _, said = _bans(job)
    stage = [Replica("a", "a:1"), Replica("liar", "l:1")]
    origin = 30 if restarted else 0  # a coordinator started mid-job: its members from step 0
    for step in range(origin, 41):
        bans.saw([[Replica("b", "b:1")], stage], step)
    assert bans.first_seen["liar"] == 0
    verdict = Verdict("liar", 1, "its outputs differ")
    ledger = StepLedger(step=40, microbatches=8, stages=2, microbatch_size=1)
    assert await bans.screen("t", _result(40, 0, touched=("liar",), verdicts=(verdict,)), ledger)
    assert rolled == [39] and "at or before step 39" in said[0]


@pytest.mark.attack("64-first-seen")
async def test_a_restarted_scheduler_keeps_when_each_member_came(tmp_path: Path) -> None:
    """Issue 64, item 3: a coordinator started mid-job took every peer present at its start as
    a member from step 0, so after a scheduler restart a liar that came at step 20 and lied at
    35 rolled the job back to step 0 (or as far as its doubt window, 76 steps here). When each
    member came is kept in the job store: the rollback goes to step 20, after a restart too."""
    job = _audited(tmp_path, 0.045)
    with JobStore(tmp_path / "jobs.db") as store:
        job_id = store.create("j", "spec", "/data", 100).id
        first, rolled, _, _ = _bans(job, StoredBans(store, job_id))
        for step in range(0, 30):
            liar = [Replica("liar", "l:1")] if step >= 20 else []
            first.saw([[Replica("b", "b:1")], [Replica("a", "a:1"), *liar]], step)
        restarted, rolled, _, said = _bans(job, StoredBans(store, job_id))
        for step in range(30, 36):  # its first lease: step 30, the liar a member at its start
            restarted.saw(
                [[Replica("b", "b:1")], [Replica("a", "a:1"), Replica("liar", "l:1")]], step
            )
        await restarted.ban("liar", 1, "its outputs differ", 35)
        assert rolled == [20] and "at or before step 20" in said[0]
        assert store.seen(job_id) == {"a": 0, "b": 0, "liar": 20}
        # a later step never moves it on, an earlier one (a replay after a rollback) back
        restarted.saw([[Replica("c", "c:1")]], 40)
        restarted.saw([[Replica("c", "c:1")]], 37)
        assert store.seen(job_id)["c"] == 37


class _Binding(_Book):
    binds_credentials = True


@pytest.mark.attack("64-credential")
async def test_a_ban_binds_the_liars_certificate_where_ids_are_bound_to_certificates(
    tmp_path: Path,
) -> None:
    """Issue 64, "Bans bind a credential wherever one exists": a peer banned under
    `gpu1.alice` came back as `gpu2.alice`, which the same invite certifies, and was a member
    again (and `alice`, and `x.gpu1.alice` under a certificate named `gpu1.alice`). Where peer
    ids are bound to certificates, a ban bars every id of the liar's credential; its other ids
    already members are left out with it and their work rolled back too. Without that binding
    (the shared token) a ban stays by id: a token holder announcing `x.alice` must not get
    alice banned."""
    stage = [Replica(p, f"{p}:1") for p in ("gpu1.alice", "gpu2.alice", "bob", "alicex")]
    book = _Binding([], [])
    rolled: list[int] = []
    bans = _kept(book, rolled.append)
    bans.saw([stage[2:]], 0)
    bans.saw([stage[1:]], 3)  # its second id joined at step 3, the one caught at 5
    bans.saw([stage], 5)
    await bans.ban("gpu1.alice", 0, "its outputs differ", 9)
    back = [Replica(p, f"{p}:2") for p in ("alice", "gpu3.alice", "x.gpu1.alice")]
    members = bans.standing.members(lambda: [[*stage, *back]])
    assert [r.peer for r in members()[0]] == ["bob", "alicex"]
    assert rolled == [3]  # the work of its other id too
    # kept: a restarted scheduler's coordinator bars them from its start
    again = _kept(_Binding(book.bans, []), rolled.append)
    assert [r.peer for r in again.standing.members(lambda: [[*stage, *back]])()[0]] == [
        "bob",
        "alicex",
    ]
    # the shared token alone binds no id to a certificate: by id only
    by_id = _kept(_Book([], []), rolled.append)
    await by_id.ban("gpu1.alice", 0, "its outputs differ", 9)
    assert [r.peer for r in by_id.standing.members(lambda: [stage])()[0]] == [
        "gpu2.alice",
        "bob",
        "alicex",
    ]


def test_the_doubt_window_is_where_a_steady_liar_escapes_the_audits(tmp_path: Path) -> None:
    """At the default 4.5 %, a replica of two answering 4 of 8 microbatches a step lies in
    every one unseen for 76 steps with a chance under 1e-6 (0.955^304); every answer audited: 1."""
    assert doubt_window(_audited(tmp_path, 1.0), 2) == 1
    window = doubt_window(_audited(tmp_path, 0.045), 2)
    assert window is not None and 0.955 ** (4 * window) < 1e-6 < 0.955 ** (4 * (window - 1))
    assert doubt_window(_audited(tmp_path, 0.0), 2) is None  # no audits: from its start
    assert doubt_window(None, 2) is None


@pytest.mark.attack("64-seats")
async def test_two_seats_of_one_host_convict_no_one_and_two_hosts_do() -> None:
    """Issue 64, item 4: two ids of one token holder, placed in one stage (placement spreads by
    failure domains they declare themselves), audited the honest third replica and agreed on a
    wrong re-execution: it was banned, and the job rolled back. A verdict's auditors must be
    seats of two hosts (where they are dialled); a verdict by two hosts' still convicts."""
    bans, rolled, _, _ = _bans()
    stage = [
        Replica("honest", "1.2.3.4:7000"),
        Replica("sybil1", "5.6.7.8:7000"),
        Replica("sybil2", "5.6.7.8:7001"),
        Replica("other", "9.10.11.12:7000"),
    ]
    bans.saw([[Replica("b", "b:1")], stage], 3)
    ledger = StepLedger(step=3, microbatches=4, stages=2, microbatch_size=4)
    framed = Verdict("honest", 1, "its outputs differ", ("sybil1", "sybil2"))
    result = _result(3, 0, touched=("honest",), verdicts=(framed,))
    assert not await bans.screen("t", result, ledger)  # counts: nobody it rests on is banned
    assert bans.banned == {} and rolled == []
    caught = Verdict("sybil1", 1, "its outputs differ", ("honest", "other"))
    assert await bans.screen("t", _result(3, 1, touched=("sybil1",), verdicts=(caught,)), ledger)
    assert list(bans.banned) == ["sybil1"]
    # one machine's test swarm (loopback): its seats are told apart by port
    local, _, _, _ = _bans()
    local.saw([[Replica(p, f"127.0.0.1:{7000 + i}") for i, p in enumerate("xyz")]], 0)
    verdict = Verdict("x", 0, "its outputs differ", ("y", "z"))
    await local.screen("t", _result(0, 0, touched=("x",), verdicts=(verdict,)), None)
    assert list(local.banned) == ["x"]


async def test_a_reports_touched_ids_that_are_no_members_are_not_kept() -> None:
    """A report's `touched` (the replicas its result rests on) is any token holder's word: each
    id in it was kept as a member from that step, in the store too (a synchronous write per id
    on the event loop), and skipped the entry bound as a former member. Only members some lease
    saw are."""
    bans, _, _, _ = _bans()
    bans.saw([[Replica("a", "a:1")], [Replica("b", "b:1")]], 3)
    made_up = tuple(f"x{i}" for i in range(10_000))
    assert not await bans.screen("t", _result(3, 0, touched=("a", "b", *made_up)), None)
    assert set(bans.first_seen) == {"a", "b"}
