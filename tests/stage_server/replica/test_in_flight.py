"""A replica names in Info the accumulating pushes it has taken and not yet ended
(`stage_server.replica.in_flight`), so the coordinator's late-receipt check does not lease a
microbatch again while its push still runs here: an overloaded replica's compute goes on after
its caller's deadline passed, and its receipt, landing after a replay went out under a new run,
voided the replica. The entry lasts as long as the compute, not the call: a caller that hangs up
ends the call but not a compute already running; a push still queued when its caller hung up
never runs, and is not named."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from client.trainer import PipelineTrainer
from scheduler.coordinator import LocalCoordinator, gather_state
from scheduler.coordinator.replicas import grpc_replicas
from stage_server.replica.in_flight import PushesInFlight
from stage_server.replica.messages import info_reply
from stage_server.replica.runtime import StageRuntime
from stage_server.server import StageServerOptions, start_stage_server
from swarm.deadline import within
from swarm.errors import SwarmError
from swarm.job.fingerprint import fingerprint
from swarm.net.commit_auth import SchedulerKey
from swarm.proto import control_pb2 as cpb
from swarm.rpc import epoch
from swarm.rpc.push_call import PushCall, push_deadline_s
from swarm.rpc.stage_client import StageClient, WirePush
from swarm.wire.crossing import Crossing
from tests.support.equality import assert_equal_to_local
from tests.support.inprocess import Swarm
from tests.support.jobs import make_job
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

EPOCH, STEP, RUN = 7, 0, 0x5EED


def test_an_entry_lasts_while_its_compute_runs_whoever_gave_up_first() -> None:
    flying = PushesInFlight()
    queued = flying.enter(STEP, 1, RUN)
    assert flying.listed() == [(STEP, 1, RUN)]
    queued.abandoned()  # its caller hung up before the worker took it: it never runs
    assert flying.listed() == []
    running = flying.enter(STEP, 2, RUN)
    running.started()
    running.abandoned()  # its caller hung up mid-compute: the compute goes on, and accumulates
    assert flying.listed() == [(STEP, 2, RUN)]
    running.ended()
    assert flying.listed() == []
    late = flying.enter(STEP, 3, RUN)
    late.abandoned()  # given up as the worker took it: held again for as long as it runs
    late.started()
    assert flying.listed() == [(STEP, 3, RUN)]
    late.ended()
    late.abandoned()
    assert flying.listed() == []


async def test_info_names_a_push_whose_compute_outlives_its_caller_until_its_receipt_lands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = make_job(tmp_path, training={"stages": 2}, runtime={"data_plane": "push"})
    job_id, key = fingerprint(job), SchedulerKey.generate()
    last = await start_stage_server(job, StageServerOptions(stage=1, metrics_port=0))
    last.servicer.trust(cpb.JobAnnouncement(job=job_id, scheduler_key=key.public))
    go = threading.Event()
    computing = threading.Event()
    plain = last.runtime.forward_backward

    def overloaded(*args: Any, **kwargs: Any) -> Any:  # on the worker thread
        computing.set()
        assert go.wait(30), "never let go"
        return plain(*args, **kwargs)

    monkeypatch.setattr(last.runtime, "forward_backward", overloaded)
    targets = torch.randint(0, job.model.vocab_size, (4, 16))
    client = StageClient(last.address, job, job_id, 1)

    async def push(index: int) -> None:
        epoch.leased_in(EPOCH, [b"", key.lease_ticket(job_id, STEP, index, EPOCH, 1, RUN)])
        x = torch.randn(4, 16, 32, dtype=torch.float64)
        call: WirePush = PushCall(STEP, index, Crossing(x), targets, (1,), run=RUN)
        with pytest.raises((SwarmError, asyncio.TimeoutError)):
            await client.push(call, timeout=1.0)  # its caller's deadline passes first

    def flying(info: Any) -> list[tuple[int, int, int]]:
        return [(f.step, f.index, f.run) for f in info.in_flight]

    try:
        pushes = [asyncio.create_task(push(1))]
        await wait_until(computing.is_set, "the first push computes")
        pushes.append(asyncio.create_task(push(2)))  # queued behind it
        await asyncio.gather(*pushes)  # both callers gave up
        # the first still computes and is named; the second was never taken by the worker (its
        # handler's cancellation reaches the server a moment after its caller gave up)
        await wait_until(
            lambda: last.runtime.in_flight.listed() == [(STEP, 1, RUN)], "the queued one gone"
        )
        info = await client.info()
        assert flying(info) == [(STEP, 1, RUN)] and list(info.receipts) == []
        go.set()
        await wait_until(lambda: not last.runtime.in_flight.listed(), "the compute ends")
        info = await client.info()
        assert flying(info) == []
        assert (list(info.receipts), list(info.receipt_runs)) == ([1], [RUN])
    finally:
        go.set()
        await client.close()
        await last.stop()


@pytest.mark.timeout(180)  # its recovery goes through the hops' backoffs: a busy machine's too
async def test_an_overloaded_replicas_late_receipt_is_waited_for_not_voided(
    tmp_path: Path,
    make_swarm: list[Swarm],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """End to end, on real stage servers the scheduler placed (runs drawn, as by default): the
    last stage, a pool of one, computes step 0's first microbatch for longer than its push's
    deadline. The trainer gives the microbatch back; the late-receipt check sees the push still
    in flight there under the lease's run, and leases it again only once it has ended, its
    receipt then adopted. Before, it went out again at once under a new run, that replay was
    refused behind the old push (another run), and the next check voided the honest replica:
    its step there replayed whole. The job ends at `swarm local`'s parameters either way."""
    job = make_job(
        tmp_path,
        training={"stages": 3, "steps": 2},
        runtime={"data_plane": "push", "rpc_timeout_s": 2.0},
        trust={"audit_fraction": 0.5},
    )
    caplog.set_level(logging.INFO, logger="scheduler.coordinator.late_receipts")
    caplog.set_level(logging.INFO, logger="scheduler.coordinator.push_waits")
    job_id, key = fingerprint(job), SchedulerKey.generate()
    swarm = Swarm(job)
    make_swarm.append(swarm)
    await swarm.add_replicas(1)
    await swarm.add(0)  # a second replica somewhere: runs are drawn (`LeaseSigner`)
    for stage in swarm.servers:
        for server in stage:
            server.servicer.trust(cpb.JobAnnouncement(job=job_id, scheduler_key=key.public))
    last = swarm.servers[2][0]
    plain, slow = last.runtime.forward_backward, []
    seen = _Said("is still being pushed at")
    logging.getLogger("scheduler.coordinator.late_receipts").addHandler(seen)
    logging.getLogger("scheduler.coordinator.push_waits").addHandler(seen)

    def overloaded(step: int, *args: Any, **kwargs: Any) -> Any:  # on the worker thread
        if step == 0 and not slow:
            slow.append(step)
            time.sleep(push_deadline_s(job) + 0.5)  # past its caller's deadline
            # and on until the check has seen it in flight, however loaded the machine
            assert seen.said.wait(60), "the check never saw the push in flight"
        return plain(step, *args, **kwargs)

    monkeypatch.setattr(last.runtime, "forward_backward", overloaded)
    coordinator = LocalCoordinator(
        job, job_id, swarm.members, connect=grpc_replicas(job, job_id, signing=key)
    )
    trainer = PipelineTrainer(job, coordinator, seed=0)
    try:
        await coordinator.start()
        await within(asyncio.gather(trainer.run(), coordinator.finished.wait()), 150)
        assert coordinator.error is None
        assert_equal_to_local(job, await gather_state(coordinator), tol=1e-9)
    finally:
        seen.said.set()
        for name in ("scheduler.coordinator.late_receipts", "scheduler.coordinator.push_waits"):
            logging.getLogger(name).removeHandler(seen)
        await trainer.close()
        await coordinator.close()
    assert slow, "no push was slow"
    assert "is still being pushed at" in caplog.text
    assert "voided" not in caplog.text, caplog.text


class _Said(logging.Handler):
    """Sets `said` once a record holding `words` is logged (from any thread)."""

    def __init__(self, words: str) -> None:
        super().__init__(logging.INFO)
        self.words, self.said = words, threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.words in record.getMessage():
            self.said.set()


def test_info_names_the_calls_in_flight_of_its_two_steps_within_the_bound(tmp_path: Path) -> None:
    """An honest replica names no more calls than the coordinator takes (`check_info`: two
    steps' microbatches), or the whole Info was refused and the replica left out, and none of a
    step its receipts are not of."""
    job = make_job(tmp_path, training={"stages": 2})
    rt = StageRuntime(job, 0)
    most = job.training.microbatches_per_step
    for index in range(3 * most):
        rt.in_flight.enter(index % 2, index, RUN)
    rt.in_flight.enter(5, 0, RUN)  # a step it is not at
    listed = info_reply("p", "j", rt).in_flight
    assert len(listed) == 2 * most
    assert {f.step for f in listed} <= {0, 1}
