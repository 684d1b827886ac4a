"""Replica pools with real gRPC servers (in this process, so every replica's state can be
inspected after each step): several trainers, averaging, joining mid-job, lease races."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from client.trainer import PipelineTrainer
from scheduler.coordinator import LocalCoordinator, gather_model, gather_state
from scheduler.coordinator.groups import Aggregator, Groups, Link
from stage_server.averaging.owner import Averager
from stage_server.averaging.service import PoolServicer
from stage_server.replica.runtime import StageRuntime
from stage_server.server import RunningStageServer
from swarm.errors import FailedPrecondition, NotFound
from swarm.job.fingerprint import fingerprint
from swarm.model.routes import Record
from swarm.ops.progress import StepRecord
from swarm.proto import pool_pb2_grpc
from swarm.rpc.lease import Replica, Task
from tests.support.equality import assert_equal_to_local, assert_equal_to_reference
from tests.support.inprocess import Swarm, lease_after_joined
from tests.support.jobs import make_job


async def test_two_replicas_per_stage_and_two_trainers_equal_local(
    tmp_path: Path, make_swarm: list[Swarm]
) -> None:
    job = make_job(tmp_path, training={"steps": 4, "target_batch_size": 32})
    swarm = Swarm(job)
    make_swarm.append(swarm)
    await swarm.add_replicas(2)
    checked: list[int] = []

    def after_step(record: StepRecord) -> None:
        swarm.assert_replicas_identical()  # bitwise, after every step
        checked.append(record.step)

    coordinator = LocalCoordinator(job, fingerprint(job), swarm.members, on_step=after_step)
    await swarm.train(coordinator, trainers=2)
    assert checked == [0, 1, 2, 3]
    # both replicas of every stage did work (the wiring spreads it)
    for stage in swarm.servers:
        for server in stage:
            text = server.servicer.metrics.registry.get_sample_value(
                "swarm_stage_optimizer_steps_total", dict(server.servicer.metrics.values)
            )
            assert text == 4
    assert_equal_to_local(job, await gather_state(coordinator))
    await coordinator.close()


@pytest.mark.parametrize("averaging", ["none", "int8_blockwise"])
async def test_replica_joining_mid_job_ends_identical(
    tmp_path: Path, make_swarm: list[Swarm], averaging: str
) -> None:
    # The joiner copies a member in the background from the next boundary on, and is admitted
    # once caught up (a step or two later): 8 steps leave it steps to work in. Averaged in a
    # lossy codec, the updates it follows come as the bytes the pool decoded (issue 67).
    job = make_job(
        tmp_path,
        training={"steps": 8, "target_batch_size": 32},
        compression={"averaging": averaging},
    )
    swarm = Swarm(job)
    make_swarm.append(swarm)
    await swarm.add_replicas(1)
    joined: list[RunningStageServer] = []

    async def after_step(record: StepRecord) -> None:
        if record.step == 1:  # a new replica of stage 2 appears during step 2
            joined.append(await swarm.add(2))

    coordinator = LocalCoordinator(job, fingerprint(job), swarm.members, on_step=after_step)
    # Steps 5 to 7 wait for it to be a member (a bounded wait): it has steps to work in.
    lease_after_joined(coordinator, joined, 5)
    await swarm.train(coordinator, trainers=1)
    assert joined and joined[0].runtime.step == 8
    swarm.assert_replicas_identical()
    # it did real work after joining: it accumulated samples
    samples = joined[0].servicer.metrics.registry.get_sample_value(
        "swarm_stage_samples_total", dict(joined[0].servicer.metrics.values)
    )
    assert samples and samples > 0
    if averaging == "none":  # lossy averaging is not `swarm local`'s
        assert_equal_to_local(job, await gather_state(coordinator))
    await coordinator.close()


async def test_racing_trainers_never_count_a_microbatch_twice(
    tmp_path: Path, make_swarm: list[Swarm]
) -> None:
    # Leases expire quickly, so two trainers often compute the same microbatches on
    # different replicas; the ledger accepts one gradient per microbatch and stage and voids
    # replicas that hold a second one (their other microbatches are replayed).
    job = make_job(
        tmp_path,
        training={"steps": 2, "target_batch_size": 16, "stages": 2},
        runtime={"lease_timeout_s": 0.05},
    )
    swarm = Swarm(job)
    make_swarm.append(swarm)
    await swarm.add_replicas(2)
    coordinator = LocalCoordinator(job, fingerprint(job), swarm.members)
    await swarm.train(coordinator, trainers=2)
    swarm.assert_replicas_identical()
    assert_equal_to_local(job, await gather_state(coordinator))
    await coordinator.close()


async def test_the_model_is_taken_at_one_step(tmp_path: Path, make_swarm: list[Swarm]) -> None:
    # After training, one replica of stage 1 is put back to step 0 (a replica that missed the
    # last APPLY, say): the model comes from its peer, at the job's last step, or not at all.
    job = make_job(tmp_path, training={"steps": 2, "target_batch_size": 16})
    swarm = Swarm(job)
    make_swarm.append(swarm)
    for stage in range(4):
        for _ in range(2 if stage == 1 else 1):
            await swarm.add(stage)
    coordinator = LocalCoordinator(job, fingerprint(job), swarm.members)
    await swarm.train(coordinator, trainers=1)
    initial = StageRuntime(job, 1, "cpu").export_state()
    behind, ahead = coordinator.replicas()[1]
    await coordinator.client(1, behind).load_state(0, initial)
    step, state = await gather_model(coordinator)
    assert step == 2
    assert_equal_to_local(job, state)
    await coordinator.client(1, ahead).load_state(0, initial)
    with pytest.raises(FailedPrecondition, match="is at step 0, not 2"):
        await gather_model(coordinator)
    await coordinator.close()


async def test_the_trainer_follows_moves_and_new_addresses(tmp_path: Path) -> None:
    # c moves from stage 2 to stage 1, a comes back at another address, d leaves.
    trainer = PipelineTrainer(make_job(tmp_path), coordinator=None)  # type: ignore[arg-type]
    try:
        trainer.sync(
            [
                [Replica("a", "h:1")],
                [Replica("b", "h:2")],
                [Replica("c", "h:3")],
                [Replica("d", "h:4")],
            ]
        )
        first_a = trainer.clients["a"]
        made = [trainer.clients[p] for p in "cd"]  # a client is made when a call needs it
        trainer.sync([[Replica("a", "h:9")], [Replica("b", "h:2"), Replica("c", "h:3")], [], []])
        assert [trainer.wiring.stage_of(p) for p in "abcd"] == [0, 1, 1, None]
        assert trainer.wiring.choose(1, 1.0) in ("b", "c")
        assert trainer.clients["a"].address == "h:9" and trainer.clients["a"] is not first_a
        assert (trainer.clients["c"].address, trainer.clients["c"].stage) == ("h:3", 1)
        # the replaced clients of a and c, and departed d's (nothing kept of a peer that left),
        # closed later
        assert len(trainer._retiring) == 3 and "d" not in trainer.clients
        assert trainer.clients["c"] is not made[0]
        trainer.sync([])  # a lease before the job started: no view of the stages
        assert [trainer.wiring.stage_of(p) for p in "abcd"] == [0, 1, 1, None]
    finally:
        await trainer.close()


class _Releases:
    """A `Coordinator` that only records releases (the trainer under test leases nothing)."""

    def __init__(self) -> None:
        self.released: list[list[int]] = []

    async def release(
        self, trainer: str, indices: Sequence[int], failure: str | None = None
    ) -> None:
        self.released.append(list(indices))


async def test_a_failed_microbatch_of_an_older_step_gives_nothing_back(tmp_path: Path) -> None:
    # No replica anywhere: every microbatch fails. The one of the step the trainer leases now is
    # given back; a straggler of an older step must not give away the same index of this one.
    coordinator = _Releases()
    trainer = PipelineTrainer(make_job(tmp_path), coordinator)  # type: ignore[arg-type]
    trainer._leased_step = 5
    try:
        await trainer._run_task(Task(step=4, index=1, stages=frozenset(range(4))))
        assert coordinator.released == []
        await trainer._run_task(Task(step=5, index=1, stages=frozenset(range(4))))
        assert coordinator.released == [[1]]
    finally:
        await trainer.close()


# --- uneven links (issue 43): parts by water-filling, a client, an aggregator ------------------


@contextlib.asynccontextmanager
async def _aggregator(job_id: str) -> AsyncIterator[tuple[str, Averager]]:
    """A PoolService that owns parts of `job_id`'s rounds and holds no model (an aggregator)."""

    def route(job: str, stage: int) -> None:
        if job != job_id:
            raise NotFound(f"job {job!r} is not served here")

    server, averager = grpc.aio.server(), Averager()
    servicer = PoolServicer(
        averager, route=route, chunk_bytes=1 << 20, max_bytes=1 << 28, timeout_s=30
    )
    pool_pb2_grpc.add_PoolServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    aggregator_servers[address] = server
    try:
        yield address, averager
    finally:
        await server.stop(None)
        del aggregator_servers[address]


aggregator_servers: dict[str, grpc.aio.Server] = {}  # address -> an `_aggregator`'s server


def _summed(averager: Averager) -> int:
    """How many rounds `averager` summed a part of."""
    return len(averager._summed)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("mode", "aggregated"), [("step", False), ("step", True), ("local", True), ("eager", True)]
)
async def test_uneven_parts_a_client_and_an_aggregator_equal_local(
    tmp_path: Path, make_swarm: list[Swarm], mode: str, aggregated: bool
) -> None:
    """Three replicas a stage on links of 10, 100 and 60 Mbit/s: the slow one owns nothing (a
    client), the others uneven parts; with an aggregator, it owns parts too and contributes
    nothing. The replicas end bitwise alike, and the job equals `swarm local` (`--routes` for
    local steps and eager rounds; float64: only where the additions are split differs, not
    their order, so the route record needs no weights)."""
    pool = {} if mode == "step" else {"mode": "local", "sync_every": 2}
    pool |= {"overlap": "eager"} if mode == "eager" else {}
    job = make_job(
        tmp_path,
        training={"steps": 4, "target_batch_size": 32, "checkpoint_every": 0},
        pool=pool,
        runtime={"data_plane": "relay"},
    )
    swarm = Swarm(job)
    make_swarm.append(swarm)
    await swarm.add_replicas(3)
    mbit = 1e6 / 8
    rates = {
        s.address: r * mbit
        for stage in swarm.servers
        for s, r in zip(stage, (10, 100, 60), strict=True)
    }
    async with _aggregator(fingerprint(job)) as (address, aggregator):
        offered = [Aggregator("agg", address, Link(30 * mbit))] if aggregated else []
        groups = Groups(lambda peer: Link(rates[peer]), lambda stage: offered)
        routes: list[Record] = []
        coordinator = LocalCoordinator(
            job, fingerprint(job), swarm.members, groups=groups, on_route=routes.append
        )
        await swarm.train(coordinator, trainers=2)
        for stage in swarm.servers:  # the parameters (each inner optimizer is its own)
            first = stage[0].runtime.state_dict()
            for other in stage[1:]:
                for name, tensor in other.runtime.state_dict().items():
                    assert torch.equal(tensor, first[name]), name
        group = groups.of(0, swarm.members()[0])
        assert group.parts.weights[0] == 0 and all(w > 0 for w in group.parts.weights[1:])
        for stage in swarm.servers:  # the client summed no part; the others did
            assert _summed(stage[0].servicer.averager) == 0
            assert all(_summed(s.servicer.averager) > 0 for s in stage[1:])
        assert (_summed(aggregator) > 0) == aggregated
        assert_equal_to_reference(job, await gather_state(coordinator), routes, tol=1e-9)
        await coordinator.close()


@pytest.mark.timeout(180)
async def test_an_aggregator_dying_mid_round_sits_out_and_the_retry_is_exact(
    tmp_path: Path, make_swarm: list[Swarm]
) -> None:
    """The aggregator's server stops as the first contribution reaches it (its calls cut, as a
    SIGKILL would): every replica names it, none is left out, the aggregator sits out the retry,
    and the job equals `swarm local`."""
    job = make_job(tmp_path, training={"steps": 3, "target_batch_size": 32})
    swarm = Swarm(job)
    make_swarm.append(swarm)
    await swarm.add_replicas(3)
    async with _aggregator(fingerprint(job)) as (address, aggregator):
        server = aggregator_servers[address]
        reduce = aggregator.reduce
        stopping: list[asyncio.Future[None]] = []

        async def dies(*a: Any, **k: Any) -> Any:
            if not stopping:  # mid-round: a contribution has arrived
                stopping.append(asyncio.ensure_future(server.stop(None)))
            return await reduce(*a, **k)

        aggregator.reduce = dies  # type: ignore[method-assign]
        offered = [Aggregator("agg", address, Link(100.0))]
        groups = Groups(lambda peer: Link(100.0), lambda stage: offered)
        coordinator = LocalCoordinator(job, fingerprint(job), swarm.members, groups=groups)
        await swarm.train(coordinator, trainers=2)
        await asyncio.gather(*stopping)
        assert stopping, "the aggregator took part in a round"
        assert coordinator.metrics.aborted_rounds._value.get() >= 1
        assert address not in groups.of(0, swarm.members()[0]).members  # it sits out
        assert all(len(stage) == 3 for stage in coordinator.replicas())  # no replica blamed
        swarm.assert_replicas_identical()
        assert_equal_to_local(job, await gather_state(coordinator))
        await coordinator.close()
