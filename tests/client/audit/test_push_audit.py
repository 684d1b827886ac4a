"""The push plane's audits (`client.audit.push_audit`) with replicas faked behind the
routes' `ClientFactory` seam: a stage drawn whose pool has nobody else to re-execute its work
(a pool of one) has its record's tensors left where they are. Fetching them crossed the
trainer's link for nothing: on issue 52's shaped bench (one replica a stage, home-link rates)
they were most of the bytes the trainer's link carried, and its steps ran 0.71x unshaped."""

from __future__ import annotations

import asyncio
import math
import random
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from client.audit.audits import Audits
from client.audit.push_audit import PushAudits
from client.audit.reexecute import StageReexecutor
from client.metrics import TrainerMetrics
from swarm.clock import MonotonicClock
from swarm.deadline import within
from swarm.job.config import JobConfig
from swarm.policy.wiring import Wiring
from swarm.proto import stage_pb2 as pb
from swarm.rpc.lease import ContributionAudit, Replica
from swarm.rpc.routes import Routes
from swarm.wire import codec
from swarm.wire.digest import digest
from tests.support.jobs import make_job

IDS = torch.zeros(2, 4, dtype=torch.long)  # the microbatch's token ids, and its targets


class Flight:
    """The Record calls for tensors in flight at once, across every replica's client."""

    def __init__(self) -> None:
        self.now = self.most = 0


class Recorded:
    """A replica's client that keeps what `Record` was asked; its commitment is honest: the
    token ids and targets the trainer sent (`IDS`), nothing else recorded."""

    def __init__(self, address: str, stage: int, flight: Flight) -> None:
        self.address, self.stage, self.flight = address, stage, flight
        self.asked: list[bool] = []  # `tensors` of each Record call

    async def record(self, step: int, index: int, run: int, *, tensors: bool) -> Any:
        self.asked.append(tensors)
        if tensors:  # the tensors take a while to come: whatever else is asked meanwhile flies
            self.flight.now += 1
            self.flight.most = max(self.flight.most, self.flight.now)
            for _ in range(3):
                await asyncio.sleep(0)
            self.flight.now -= 1
        commitment = pb.Commitment(
            inputs=digest(IDS) if self.stage == 0 else b"",
            targets=digest(IDS),
            stage=self.stage,
            microbatch=pb.MicrobatchId(step=step, index=index),
            run=run,
        )
        held = {"inputs": IDS} if self.stage == 0 else {}
        held["targets"] = IDS
        return commitment, {n: codec.encode(t, n) for n, t in held.items()} if tensors else {}


def _push_audits(
    job: JobConfig, pools: list[list[str]], fraction: float = 1.0
) -> tuple[PushAudits, dict[str, Recorded]]:
    made: dict[str, Recorded] = {}
    flight = Flight()

    def factory(
        address: str, job: JobConfig, job_id: str, stage: int, token: Any, /, **_: Any
    ) -> Any:
        made[address] = Recorded(address, stage, flight)
        return made[address]

    wiring = Wiring(job.training.stages, clock=MonotonicClock(), rng=random.Random(0))
    routes = Routes(job, "job", None, wiring, client_factory=factory)
    for stage, peers in enumerate(pools):
        routes.follow(stage, [Replica(p, p) for p in peers])
    audits = Audits(
        fraction, 0.0, StageReexecutor(job, routes), TrainerMetrics("job"), random.Random(0)
    )
    return PushAudits(job, audits, routes), made


def _skipped(p: PushAudits) -> float:
    return p.audits.metrics._audits.labels(job="job", outcome="skipped")._value.get()


async def test_a_stage_no_one_could_redo_is_not_fetched(tmp_path: Path) -> None:
    job = make_job(tmp_path, training={"stages": 2}, runtime={"data_plane": "push"})
    push, made = _push_audits(job, [["s0"], ["s1"]])  # every stage drawn (fraction 1)
    verdicts, runs, digests = await push.audit(3, 1, 7, ["s0", "s1"], IDS, IDS)
    assert (verdicts, runs, digests) == ((), 0, [])
    assert made["s0"].asked == [False] and made["s1"].asked == [False]  # commitments only
    assert _skipped(push) == 2


async def test_a_stage_another_replica_could_redo_is_fetched(tmp_path: Path) -> None:
    job = make_job(tmp_path, training={"stages": 2}, runtime={"data_plane": "push"})
    push, made = _push_audits(job, [["s0", "t0"], ["s1"]])
    await push.audit(3, 1, 7, ["s0", "s1"], IDS, IDS)
    assert made["s0"].asked == [False, True]  # its record asked for: t0 could redo it
    assert made["s1"].asked == [False]


POOLS = [["s0", "t0"], ["s1", "t1", "u1"], ["s2", "t2"]]
CHAIN = ["s0", "s1", "s2"]


async def test_an_audited_contribution_is_redone_from_its_neighbours_records(
    tmp_path: Path,
) -> None:
    """Its replica is not asked for its record on the contribution's account: it would learn
    it is drawn before the round, and send an honest contribution exactly then. Its neighbours
    are (here their records hold nothing to redo: no digest, the coordinator skips it)."""
    job = make_job(tmp_path, training={"stages": 3}, runtime={"data_plane": "push"})
    push, made = _push_audits(job, POOLS, fraction=0.0)  # no stage drawn for its answers
    verdicts, runs, digests = await push.audit(3, 1, 7, CHAIN, IDS, IDS, {1: 12345})
    assert (verdicts, runs, digests) == ((), 0, [])
    assert made["s1"].asked == [False]  # its commitment only
    assert made["s0"].asked == [False, True] and made["s2"].asked == [False, True]


async def test_a_stage_drawn_for_its_answers_is_asked_alike_whether_its_contribution_is(
    tmp_path: Path,
) -> None:
    job = make_job(tmp_path, training={"stages": 3}, runtime={"data_plane": "push"})
    asked = []
    for contributions in ({}, {1: 12345}):
        push, made = _push_audits(job, POOLS)  # every stage drawn for its answers
        await push.audit(3, 1, 7, CHAIN, IDS, IDS, contributions)
        asked.append(made["s1"].asked)
    assert asked[0] == asked[1] == [False, True]


async def test_each_record_is_fetched_once_and_every_stages_at_once(tmp_path: Path) -> None:
    """Issue 69: the records a microbatch's audits ask for are asked together (the report waits
    for the slowest, not for their sum), and one asked by the answers' audit and by a
    neighbour's contribution audit alike is fetched once."""
    job = make_job(tmp_path, training={"stages": 3}, runtime={"data_plane": "push"})
    push, made = _push_audits(job, POOLS)  # every stage drawn for its answers
    await push.audit(3, 1, 7, CHAIN, IDS, IDS, {1: 12345})  # and stage 1's contribution
    assert [made[p].asked for p in CHAIN] == [[False, True]] * 3
    assert made["s0"].flight.most == 3


async def test_a_run_no_audit_can_reach_keeps_no_record(tmp_path: Path) -> None:
    """Its id is 0 (no replica keeps a record of it) while no stage has a second replica; a
    second replica of any stage, or a contribution the coordinator drew, gives it one."""
    job = make_job(tmp_path, training={"stages": 2}, runtime={"data_plane": "push"})
    alone, _ = _push_audits(job, [["s0"], ["s1"]])
    assert alone.run_id([]) == 0
    assert alone.run_id([ContributionAudit(1, "s1", 12345)]) != 0
    paired, _ = _push_audits(job, [["s0"], ["s1", "t1"]])
    assert {paired.run_id([]) == 0 for _ in range(8)} == {False}


class Malformed(Recorded):
    """A replica whose record's first tensor is one byte short of what its header says (a
    hostile one: an honest replica's record decodes)."""

    async def record(self, step: int, index: int, run: int, *, tensors: bool) -> Any:
        commitment, held = await super().record(step, index, run, tensors=tensors)
        if tensors and self.stage == 0:
            held["inputs"].data = held["inputs"].data[:-1]
        return commitment, held


async def test_a_record_that_does_not_decode_is_a_verdict_on_its_replica(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It raised out of the audit: the trainer stopped (or, deferred, the audit was lost unseen).
    monkeypatch.setitem(globals(), "Recorded", Malformed)
    job = make_job(tmp_path, training={"stages": 2}, runtime={"data_plane": "push"})
    push, made = _push_audits(job, [["s0", "t0"], ["s1"]])
    verdicts, _, _ = await push.audit(3, 1, 7, ["s0", "s1"], IDS, IDS)
    assert made["s0"].asked == [False, True]  # its record was fetched (t0 could redo it)
    assert [(v.peer, v.stage) for v in verdicts] == [("s0", 0)], verdicts
    assert "does not decode" in verdicts[0].evidence and "payload bytes" in verdicts[0].evidence


Honest = Recorded


class Oversized(Recorded):
    """A replica whose record's outputs are 4M values of hadamard3 (1.5 MB, within any
    message's bound): far more than a microbatch's boundary crossing holds."""

    async def record(self, step: int, index: int, run: int, *, tensors: bool) -> Any:
        commitment, held = await super().record(step, index, run, tensors=tensors)
        if tensors and self.stage == 0:
            held["outputs"] = codec.encode(torch.ones(1 << 22), "outputs", codec.CODEC_HADAMARD3)
        return commitment, held


async def test_a_record_larger_than_its_microbatch_is_a_verdict_and_never_decoded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record's tensors were decoded whatever their size, on the trainer's event loop: a
    hostile replica's 1 GiB of hadamard3 took ~64 GB to widen. A record tensor holds one
    microbatch's crossing at most (`ids` times the boundary's width); more is its replica's
    lie, never decoded. What is decoded is decoded off the loop."""
    monkeypatch.setitem(globals(), "Recorded", Oversized)
    decoded: list[tuple[int, bool]] = []
    real = codec.decode
    loop_thread = threading.current_thread()

    def spy(msg: Any, *a: Any, **kw: Any) -> Any:
        decoded.append((math.prod(msg.shape), threading.current_thread() is loop_thread))
        return real(msg, *a, **kw)

    monkeypatch.setattr("client.audit.push_fetch.codec.decode", spy)
    job = make_job(tmp_path, training={"stages": 2}, runtime={"data_plane": "push"})
    push, made = _push_audits(job, [["s0", "t0"], ["s1"]])
    verdicts, _, _ = await push.audit(3, 1, 7, ["s0", "s1"], IDS, IDS)
    assert made["s0"].asked == [False, True]
    assert [(v.peer, v.stage) for v in verdicts] == [("s0", 0)], verdicts
    assert "4194304 values" in verdicts[0].evidence, verdicts[0].evidence
    assert decoded == []  # nothing of that record: its other tensors are its lie's too
    monkeypatch.setitem(globals(), "Recorded", Honest)
    push, made = _push_audits(job, [["s0", "t0"], ["s1"]])
    assert (await push.audit(3, 1, 7, ["s0", "s1"], IDS, IDS))[0] == ()
    assert made["s0"].asked == [False, True]
    assert decoded and not any(on_loop for _, on_loop in decoded), decoded


async def test_a_stage_audit_cut_mid_way_ends_its_record_fetch_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage drawn for both audits fetches its own record beside the contribution's redo; an
    audit cut there (the step moved on: `LateAudits.cut`, or the trainer stopping) left the fetch
    running across the trainer's link after the cut, unawaited (a review found it)."""
    job = make_job(tmp_path, training={"stages": 2}, runtime={"data_plane": "push"})
    push, _ = _push_audits(job, [["s0", "t0"], ["s1"]])
    fetching, redoing = asyncio.Event(), asyncio.Event()
    fetch_cancelled: list[bool] = []

    async def fetched(records: Any, k: int) -> None:
        fetching.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            fetch_cancelled.append(True)
            raise

    async def redo(*args: Any) -> Any:
        redoing.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(push, "_fetched", fetched)
    monkeypatch.setattr(push.contributions, "audit", redo)
    stage = asyncio.create_task(push._stage(3, 1, 0, True, 99, None, IDS, IDS, 7.0))  # type: ignore[arg-type]
    await within(asyncio.gather(fetching.wait(), redoing.wait()), 5.0)
    stage.cancel()
    await asyncio.gather(stage, return_exceptions=True)
    assert fetch_cancelled == [True]
