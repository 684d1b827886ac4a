"""The audit's sampler and its arbitration (`client.audit.audits`), with replicas faked
behind its `Reexecutor` seam: who is drawn, and who a disagreement convicts."""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from client.audit.audits import TOLERANCE, Audits, Redone, Work, differs
from client.data_plane.hops import StageHops
from client.data_plane.plane import audits_of
from client.metrics import TrainerMetrics
from swarm.clock import MonotonicClock
from swarm.errors import BadReply, PeerUnavailable
from swarm.job.config import JobConfig
from swarm.policy.wiring import Wiring
from swarm.rpc.lease import ContributionAudit, GradientDigest
from swarm.rpc.routes import Routes
from swarm.wire import codec
from swarm.wire.crossing import Crossing
from tests.support.jobs import make_job
from tests.support.waiting import wait_until

TRUE_OUT, TRUE_GRAD = torch.arange(6.0).reshape(2, 3), torch.ones(2, 3)
WRONG = torch.full((2, 3), 0.01)
DIGEST = (0.5, 2.0, 3.0)  # a parameter gradient's (r·g, Σ|r·g|, ‖g‖), as honest auditors give it


class Replicas:
    """Three replicas of stage 1 (`a`, `b`, `c`); `liars` answer re-executions wrongly; `gone`
    answer nothing."""

    def __init__(
        self,
        liars: set[str] = frozenset(),
        gone: set[str] = frozenset(),
        broken: set[str] = frozenset(),
    ) -> None:
        self.liars, self.gone, self.asked = set(liars), set(gone), []
        self.broken = set(broken)  # answer what cannot be a re-execution (`BadReply`)

    peers_of_stage = ["a", "b", "c"]

    def peers(self, stage: int) -> list[str]:
        return list(self.peers_of_stage)

    async def redo(
        self, peer: str, step: int, index: int, work: Work, digest_seed: int = 0
    ) -> Redone:
        self.asked.append(peer)
        if peer in self.gone:
            raise PeerUnavailable(f"{peer} is gone")
        if peer in self.broken:
            raise BadReply("its Forward answer holds no 'outputs'")
        digest = (DIGEST[0] + (peer in self.liars), *DIGEST[1:]) if digest_seed else None
        if peer in self.liars:
            return Redone(TRUE_OUT + WRONG, TRUE_GRAD, digest)
        return Redone(TRUE_OUT.clone(), TRUE_GRAD.clone(), digest)


def _work(outputs: torch.Tensor = TRUE_OUT, grads: torch.Tensor = TRUE_GRAD) -> Work:
    inputs = torch.zeros(2, 3)
    return Work(1, Crossing(inputs), torch.ones(2, 3), outputs, grads, "a", "a")


def _audits(replicas: Replicas, fraction: float = 1.0, seed: int = 0) -> Audits:
    return Audits(fraction, 1e-9, replicas, TrainerMetrics("job"), rng=random.Random(seed))


def _count(audits: Audits, outcome: str) -> float:
    return audits.metrics._audits.labels(job="job", outcome=outcome)._value.get()


def test_the_sampler_draws_each_stage_with_the_fraction() -> None:
    audits = _audits(Replicas(), fraction=0.1, seed=7)
    drawn = sum(len(audits.drawn(range(4))) for _ in range(5000))
    assert 0.08 * 20000 < drawn < 0.12 * 20000
    assert _audits(Replicas(), fraction=0.0).drawn(range(4)) == []
    assert _audits(Replicas(), fraction=1.0).drawn(range(4)) == [0, 1, 2, 3]


def test_the_default_draw_is_the_operating_systems() -> None:
    # Not a seeded generator a replica could replay: the draw comes after the answers, from
    # randomness no replica shares.
    audits = Audits(0.5, 0.0, Replicas(), TrainerMetrics("job"))
    assert isinstance(audits.rng, random.SystemRandom)


async def test_an_honest_answer_is_agreed_by_one_auditor_bitwise() -> None:
    replicas = Replicas()
    audits = _audits(replicas)
    assert await audits.audit(0, 0, [_work()]) == ([], 1)
    assert len(replicas.asked) == 1 and replicas.asked[0] in ("b", "c")  # never the audited
    assert _count(audits, "agreed") == 1
    assert audits.metrics.audit_difference._value.get() == 0.0
    assert audits.metrics.audit_runs._value.get() == 1


@pytest.mark.parametrize("item", ["outputs", "grads"])
async def test_a_lying_replica_is_convicted_by_two_auditors(item: str) -> None:
    replicas = Replicas()
    audits = _audits(replicas)
    work = _work(TRUE_OUT + WRONG) if item == "outputs" else _work(grads=TRUE_GRAD * 2)
    (verdict,), runs = await audits.audit(3, 5, [work])
    assert runs == 2
    assert verdict.peer == "a" and verdict.stage == 1
    assert "microbatch (3, 5) at stage 1" in verdict.evidence
    assert sorted(replicas.asked) == ["b", "c"]  # both others re-executed it
    assert _count(audits, "caught") == 1


async def test_a_lying_auditor_is_convicted_not_the_audited() -> None:
    for seed in range(10):  # whichever of the two others is asked first
        replicas = Replicas(liars={"b"})
        audits = _audits(replicas, seed=seed)
        verdicts, _ = await audits.audit(0, 0, [_work()])
        if replicas.asked[0] == "b":
            (verdict,) = verdicts
            assert verdict.peer == "b" and "re-executed" in verdict.evidence
            assert replicas.asked == ["b", "c"]
        else:  # the honest auditor agreed: nobody is asked again, nobody is accused
            assert verdicts == [] and replicas.asked == ["c"]


async def test_an_auditor_that_answers_nothing_of_use_is_said_and_another_asked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A review's repro: an auditor whose every answer is no re-execution (one that does not
    # decode) was said at INFO, below the default level, and no other auditor was asked: the
    # stage's work went unaudited for as long as it was drawn first.
    for seed in range(10):  # whichever of the two others is asked first
        replicas = Replicas(broken={"b"})
        audits = _audits(replicas, seed=seed)
        with caplog.at_level(logging.WARNING, logger="client.audit.audits"):
            assert await audits.audit(0, 0, [_work()]) == ([], 1)
        assert replicas.asked[-1] == "c" and _count(audits, "agreed") == 1
        if replicas.asked[0] == "b":
            said = [r.getMessage() for r in caplog.records if "on b" in r.getMessage()]
            assert said and "another auditor is asked" in said[-1], said


async def test_an_auditor_that_answered_nothing_is_not_the_arbitrator() -> None:
    # A review of the fallback: the auditor asked in place of one that answered nothing was
    # arbitrated by that same one, half the time: undecided, though a fourth replica could
    # have judged. The liar is convicted whichever is drawn first.
    for seed in range(12):
        replicas = Replicas(broken={"b"})
        replicas.peers_of_stage = ["a", "b", "c", "d"]
        audits = _audits(replicas, seed=seed)
        verdicts, _ = await audits.audit(0, 0, [_work(TRUE_OUT + WRONG)])
        assert [v.peer for v in verdicts] == ["a"], (seed, replicas.asked)


async def test_what_a_seeded_audit_compares_is_decoded_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A review of the lazy decoding: the producers' answers were decoded again, on the loop,
    # where a contribution's audit compared the second auditor's answers with them.
    threads: list[str] = []
    decode = codec.decode

    def noted(t: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        threads.append(threading.current_thread().name)
        return decode(t, *args, **kwargs)

    monkeypatch.setattr(codec, "decode", noted)
    work = _work(codec.encode(TRUE_OUT, "outputs"), codec.encode(TRUE_GRAD, "grad_inputs"))
    found = await _audits(Replicas()).judge(0, 0, work, seed=7)
    assert found.verdicts == [] and found.runs == 2  # two auditors, each agreeing
    main = threading.main_thread().name
    assert threads and main not in threads, threads


async def test_no_verdict_on_one_word_against_another() -> None:
    # The second auditor is gone: a disagreement with nobody to arbitrate convicts nobody.
    replicas = Replicas(gone={"b"})
    audits = _audits(replicas, seed=1)
    verdicts, _ = await audits.audit(0, 0, [_work(TRUE_OUT + WRONG)])
    # Whichever was asked first: c re-executed it (b, first, answered nothing: c was asked in
    # its place), and nobody is left to arbitrate.
    assert "c" in replicas.asked
    assert verdicts == [] and _count(audits, "undecided") == 1


async def test_an_audit_is_skipped_where_no_other_replica_answers() -> None:
    audits = _audits(Replicas(gone={"b", "c"}))
    assert await audits.audit(0, 0, [_work(TRUE_OUT + WRONG)]) == ([], 0)
    assert _count(audits, "skipped") == 1


def test_differs_is_relative_and_exact_for_equal_tensors() -> None:
    assert differs(TRUE_OUT, TRUE_OUT.clone()) == 0.0
    assert differs(TRUE_OUT + 5e-3, TRUE_OUT) == pytest.approx(1e-3, rel=1e-4)
    assert differs(TRUE_OUT, TRUE_OUT[:1]) == float("inf")
    assert differs(TRUE_OUT * float("nan"), TRUE_OUT) == float("inf")
    assert differs(None, None) == 0.0 and differs(None, TRUE_OUT) == float("inf")


async def test_an_audited_contribution_is_digested_by_two_auditors_whatever_the_draw() -> None:
    """`a` accumulated the microbatch and its contribution is audited: both others redo it with
    the audit's seed, and their digest, equal, is what the coordinator gets; its answers are
    checked as any audit's. Another stage's audit, or another replica's, asks nothing."""
    replicas = Replicas()
    audits = _audits(replicas, fraction=0.0)  # no stage drawn for its answers
    audit = ContributionAudit(1, "a", 99)
    verdicts, runs, digests = await audits.audited(0, 3, [_work()], [audit])
    assert verdicts == [] and runs == 2 and sorted(replicas.asked) == ["b", "c"]
    (digest,) = digests
    assert digest == GradientDigest(1, "a", *DIGEST, digest.auditors, 99)
    assert digest.auditors in ("b and c", "c and b")
    others = [ContributionAudit(2, "a", 99), ContributionAudit(1, "b", 99)]
    assert await audits.audited(0, 3, [_work()], others) == ([], 0, [])


class HeldReplicas(Replicas):
    """`Replicas` whose re-executions all wait until `release` is set: what is asked while
    they wait is asked at once."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def redo(
        self, peer: str, step: int, index: int, work: Work, digest_seed: int = 0
    ) -> Redone:
        self.asked.append(peer)
        await self.release.wait()
        self.asked.remove(peer)
        return await super().redo(peer, step, index, work, digest_seed)


async def test_audits_at_once_count_their_own_runs_and_a_digests_auditors_run_together() -> None:
    """A microbatch's result carries the re-executions its audit took; the trainer audits many
    microbatches at once, so each counts its own (reading the shared counter's rise counted the
    others' too). A contribution's two auditors are asked together, not one after the other:
    the microbatch's report waits for them."""
    replicas = HeldReplicas()
    audits = _audits(replicas)
    audit = ContributionAudit(1, "a", 99)
    both = asyncio.gather(audits.audited(0, 0, [_work()], [audit]), audits.audited(0, 1, [_work()]))
    await wait_until(lambda: len(replicas.asked) == 3, "three re-executions asked at once")
    replicas.release.set()
    (_, digesting, _), (_, answers, _) = await both
    assert (digesting, answers) == (2, 1)
    assert audits.metrics.audit_runs._value.get() == 3


async def test_a_lying_second_auditor_of_a_contribution_is_convicted() -> None:
    """A contribution's audit asks both others at once (its digest needs two). Where the liar is
    asked second, the first agreed with the answers: its own answers must still be held to
    those two, which agree, or an auditor that lies goes unseen (it did: nobody compared them)."""
    asked_second = 0
    for seed in range(10):
        replicas = Replicas(liars={"c"})
        audits = _audits(replicas, fraction=0.0, seed=seed)
        audit = ContributionAudit(1, "a", 99)
        verdicts, runs, digests = await audits.audited(0, 3, [_work()], [audit])
        (verdict,) = verdicts
        assert verdict.peer == "c" and verdict.stage == 1 and "re-executed" in verdict.evidence
        assert runs == 2 and [d.auditors for d in digests] == replicas.asked  # each one's
        assert all(d.disputed for d in digests)  # its digest disagreed too: judged above
        asked_second += replicas.asked == ["b", "c"]
    assert 0 < asked_second < 10  # both orders were met


async def test_two_auditors_that_disagree_on_a_gradient_are_both_reported_disputed() -> None:
    """Neither digest vouches for the contribution alone: each comes with its auditor named,
    `disputed`, for the coordinator to judge between them with the round's q·x
    (`scheduler.coordinator.trust.digest_disputes`). One auditor gone: nothing to judge."""
    audits = _audits(Replicas(liars={"c"}), fraction=0.0)
    _, runs, digests = await audits.audited(0, 3, [_work()], [ContributionAudit(1, "a", 99)])
    assert runs == 2 and sorted(digests, key=lambda d: d.auditors) == [
        GradientDigest(1, "a", *DIGEST, "b", 99, disputed=True),
        GradientDigest(1, "a", DIGEST[0] + 1, *DIGEST[1:], "c", 99, disputed=True),
    ]
    gone = _audits(Replicas(gone={"c"}), fraction=0.0)
    _, runs, digests = await gone.audited(0, 3, [_work()], [ContributionAudit(1, "a", 99)])
    assert digests == []  # the coordinator skips that contribution's audit


@pytest.mark.parametrize(
    ("training", "least"),
    [
        ({"tf32": True}, TOLERANCE["float16"]),  # a GPU's float32 matmuls: 10 mantissa bits
        ({"precision": "bf16-mixed"}, TOLERANCE["bfloat16"]),  # bfloat16 compute, exact wire
    ],
    ids=["tf32", "bf16-mixed"],
)
def test_the_tolerance_is_the_arithmetics_not_only_the_parameters_dtype(
    tmp_path: Path, training: dict[str, object], least: float
) -> None:
    """A float32 job that computes in less than float32 rounds, between two honest devices (or a
    CPU beside GPUs), to what its compute keeps: held to float32's 1e-4 instead, the honest
    replica whose kernels differ from the two others' would be convicted by them and banned."""
    trust = {"audit_fraction": 0.5}
    plain = make_job(tmp_path, "plain", training={"dtype": "float32"}, trust=trust)
    job = make_job(tmp_path, "low", training={"dtype": "float32", **training}, trust=trust)
    assert job.compression.forward == job.compression.backward == "none"  # no codec's allowance

    def tolerance(job: JobConfig) -> float:
        wiring = Wiring(job.training.stages, clock=MonotonicClock(), rng=random.Random(0))
        metrics = TrainerMetrics("job")
        audits = audits_of(job, StageHops(Routes(job, "job", None, wiring), 1, metrics), metrics)
        assert audits is not None
        return audits.tolerance

    assert tolerance(plain) == TOLERANCE["float32"]  # IEEE float32 everywhere: as before
    assert tolerance(job) >= least
    # a lie past the compute's rounding is still one: no wider than the coarsest arithmetic
    assert tolerance(job) <= 2e-2
