"""Audits that end after their microbatch's report (`client.audit.late_audits`): what each found
is reported when it ends; one still out once work of two steps later is given is cut, counted
and logged, never silently dropped; the job's last step waits for the earlier ones, and so does
every step where an auditor keeps no copy of a committed step's parameters to redo it on."""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from client.audit.audits import Audits
from client.audit.late_audits import LateAudits
from client.audit.push_audit import PushAudits
from client.audit.reexecute import StageReexecutor
from client.metrics import TrainerMetrics
from client.trainer import PipelineTrainer
from swarm.clock import MonotonicClock
from swarm.policy.wiring import Wiring
from swarm.rpc import late_audit
from swarm.rpc.lease import MicrobatchResult, Task, Verdict, result_from_proto, result_to_proto
from swarm.rpc.routes import Routes
from tests.support.jobs import make_job


def _metrics() -> TrainerMetrics:
    return TrainerMetrics("job", CollectorRegistry())


def _count(metrics: TrainerMetrics, outcome: str) -> float:
    return metrics._audits.labels(job="job", outcome=outcome)._value.get()


def _found(step: int, index: int) -> MicrobatchResult:
    verdict = Verdict("liar", 1, "it lied")
    return MicrobatchResult(step, index, {}, None, 0, verdicts=(verdict,), late=True)


class Sent(list[MicrobatchResult]):
    """The late audits' reports, as the scheduler was sent them (`report`)."""

    async def report(self, result: MicrobatchResult) -> None:
        self.append(result)


async def test_what_a_late_audit_found_is_reported_when_it_ends() -> None:
    sent = Sent()
    late = LateAudits(_metrics(), sent.report)
    assert late.deferred
    ends = asyncio.Event()

    async def audit() -> MicrobatchResult | None:
        await ends.wait()
        return _found(3, 5)

    late.start(3, 5, audit)
    await asyncio.sleep(0)
    assert late.running == [(3, 5)] and sent == []
    ends.set()
    await late.settled(4)
    assert sent == [_found(3, 5)] and late.running == []


async def test_an_audit_past_its_bound_is_cut_counted_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics, sent = _metrics(), Sent()
    late = LateAudits(metrics, sent.report)
    never = asyncio.Event()

    async def audit() -> MicrobatchResult | None:
        await never.wait()
        return _found(3, 5)

    late.start(3, 5, audit)
    late.start(4, 0, audit)
    late.cut(4)  # work of step 4 given: step 3 committed, or commits; its audits are in bound
    assert late.running == [(3, 5), (4, 0)] and _count(metrics, "cut") == 0
    with caplog.at_level(logging.WARNING, "client.audit.late_audits"):
        late.cut(5)  # step 4 committed: step 3's audits are past their bound
    assert late.running == [(4, 0)] and _count(metrics, "cut") == 1
    assert "microbatch (3, 5) was cut" in caplog.text
    late.cut(2)  # a rollback to step 2: step 4's audit is of work taken back
    assert late.running == [] and _count(metrics, "cut") == 2 and sent == []


async def test_a_report_that_fails_is_logged_with_its_cause(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def report(result: MicrobatchResult) -> None:
        raise ConnectionError("the scheduler is gone")

    late = LateAudits(_metrics(), report)

    async def audit() -> MicrobatchResult | None:
        return _found(2, 1)

    with caplog.at_level(logging.WARNING, "client.audit.late_audits"):
        late.start(2, 1, audit)
        await late.settled(3)
    assert "(2, 1) was not reported: the scheduler is gone" in caplog.text


async def test_an_audit_that_fails_is_counted_and_logged_with_its_cause(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Its exception went to `settled`'s gather and no further: the microbatch went unaudited
    # with no word of it.
    metrics, sent = _metrics(), Sent()
    late = LateAudits(metrics, sent.report)

    async def audit() -> MicrobatchResult | None:
        await asyncio.sleep(0)
        raise RuntimeError("the re-execution's stage client broke")

    with caplog.at_level(logging.WARNING, "client.audit.late_audits"):
        late.start(2, 6, audit)
        await late.settled(3)
    assert sent == [] and late.running == []
    assert _count(metrics, "failed") == 1
    said = "the audit of microbatch (2, 6) failed: the re-execution's stage client broke"
    assert said in caplog.text and "unaudited" in caplog.text, caplog.text


async def test_nothing_found_is_not_reported_and_no_sink_defers_nothing() -> None:
    sent = Sent()
    late = LateAudits(_metrics(), sent.report)

    async def audit() -> MicrobatchResult | None:
        return None

    late.start(2, 1, audit)
    await late.settled(3)
    assert sent == []
    assert not LateAudits(_metrics()).deferred


async def test_a_late_audits_calls_say_they_are_late_and_no_other_calls_do() -> None:
    """Its re-executions queue in turn at their auditors (`swarm.rpc.late_audit`;
    `stage_server.replica.answering`): its own calls and those of the tasks it starts are marked,
    the caller's (the pushes, an audit that gates its microbatch's report) are not."""
    seen: list[tuple[str, bool]] = []

    async def call(name: str) -> None:
        seen.append((name, late_audit.current()))

    async def audit() -> MicrobatchResult | None:
        await call("late")
        await asyncio.gather(call("late, redone at once"))  # tasks of its own
        return None

    late = LateAudits(_metrics(), report=None)
    late.start(3, 5, audit)
    await call("a push meanwhile")
    await late.settled(4)
    await call("gating")
    assert sorted(seen) == [
        ("a push meanwhile", False),
        ("gating", False),
        ("late", True),
        ("late, redone at once", True),
    ]


@pytest.mark.parametrize(
    ("training", "step", "deferred"),
    [
        ({}, 0, True),
        ({}, 3, False),  # the job's last step: no later commit bounds its audits
        ({"delayed_update": True}, 0, False),  # no copy of a committed step's parameters kept
        ({"precision": "bf16-mixed", "dtype": "float32"}, 0, False),
    ],
)
def test_an_audit_is_deferred_only_where_a_later_commit_bounds_it_and_auditors_can_redo_it(
    tmp_path: Path, training: dict[str, object], step: int, deferred: bool
) -> None:
    job = make_job(
        tmp_path,
        training={"stages": 2, "steps": 4, **training},
        runtime={"data_plane": "push"},
        trust={"audit_fraction": 0.5},
    )
    wiring = Wiring(job.training.stages, clock=MonotonicClock(), rng=random.Random(0))
    routes = Routes(job, "job", None, wiring)
    audits = Audits(0.5, 0.0, StageReexecutor(job, routes), _metrics())

    async def report(result: MicrobatchResult) -> None:
        pass

    task = Task(step, 0, frozenset({0, 1}))
    late = LateAudits(_metrics(), report)
    assert PushAudits(job, audits, routes, late).defers(task) is deferred
    assert not PushAudits(job, audits, routes).defers(task)  # nowhere to report to


def test_a_late_report_crosses_the_wire_as_one() -> None:
    found = _found(3, 5)
    assert result_from_proto(result_to_proto(found)) == found and found.late
    assert not result_from_proto(result_to_proto(replace(found, late=False))).late


async def test_a_late_audit_still_out_is_cancelled_when_the_trainer_shuts_down(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Before, the trainer's close left it running: it went on calling auditors over the
    # trainer's closed clients, and reporting to a coordinator the trainer had left.
    job = make_job(
        tmp_path,
        training={"stages": 2, "steps": 4},
        runtime={"data_plane": "push"},
        trust={"audit_fraction": 0.5},
    )
    trainer = PipelineTrainer(job, None, seed=0)  # type: ignore[arg-type]  # nothing leased
    late: LateAudits = trainer.plane.trust.late  # type: ignore[attr-defined]  # the plane's
    asked, cancelled = asyncio.Event(), asyncio.Event()

    async def audit() -> MicrobatchResult | None:
        asked.set()
        try:
            await asyncio.Event().wait()  # an auditor that never answers
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return None

    late.start(1, 2, audit)
    late.start(1, 3, audit)
    await asked.wait()
    with caplog.at_level(logging.WARNING, logger="client.audit.late_audits"):
        await trainer.close()
    assert cancelled.is_set() and late.running == []
    said = [r.getMessage() for r in caplog.records if "shut" in r.getMessage()]
    assert said == [
        "2 late audit(s) cancelled as the trainer shuts down: microbatches (1, 2), (1, 3) unaudited"
    ], said
