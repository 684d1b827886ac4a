"""A pool's PREPARE averages the replicas' gradient sums in place (`stage_server.averaging.
spill`): live stage servers (real gRPC on free ports) whose first round dies half way, after
some of its sums landed over the survivors' own, retry among the survivors and apply exactly
what one replica holding their microbatches applies."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from stage_server.server import RunningStageServer, StageServerOptions, start_stage_server
from swarm.errors import Aborted
from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.proto import stage_pb2 as pb
from swarm.rpc.stage_client import StageClient, as_tensor
from swarm.wire.crossing import Crossing
from tests.support.jobs import make_job
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

STAGE = 1  # a middle stage: its inputs are activations, its gradient comes from the next


@pytest.fixture
def job(tmp_path: Path, request: pytest.FixtureRequest) -> JobConfig:
    """The pool's job; its averaging timeout 1 s unless a test gives its own (`indirect`)."""
    timeout_s = getattr(request, "param", 1.0)
    return make_job(tmp_path, training={"stages": 3}, runtime={"averaging_timeout_s": timeout_s})


@pytest.fixture
async def servers(job: JobConfig, tmp_path: Path) -> AsyncIterator[list[RunningStageServer]]:
    """Three replicas of the pool and a fourth alone, each with its own spill directory."""
    made = []
    try:
        for k in range(4):
            opts = StageServerOptions(stage=STAGE, spill_dir=str(tmp_path / f"spill-{k}"))
            made.append(await start_stage_server(job, opts))
        yield made
    finally:
        for running in made:
            await running.stop()


async def _microbatch(client: StageClient, index: int, job: JobConfig) -> None:
    """Microbatch `index` of step 0 (its forward and backward), the same wherever it runs."""
    gen = torch.Generator().manual_seed(index)
    x = torch.randn(4, job.model.seq_len, job.model.d_model, generator=gen, dtype=torch.float64)
    out = as_tensor(await client.forward(0, index, Crossing(x)))
    await client.backward(0, index, None, torch.randn(out.shape, generator=gen, dtype=out.dtype))


def _never_sums_its_own_part(running: RunningStageServer, hold_s: float) -> None:
    """The replica sends its parts to their owners, but its own part never gets its own
    contribution (as a replica that hangs, or dies, once it has sent): its round fails."""
    averager = running.servicer.averager
    reduce = averager.reduce

    async def held(round: Any, part: int, sender: int, *args: Any, **kwargs: Any) -> Any:
        if sender == part:
            await asyncio.sleep(hold_s)
        return await reduce(round, part, sender, *args, **kwargs)

    averager.reduce = held  # type: ignore[method-assign]


async def test_a_retry_after_a_round_died_half_way_applies_the_survivors_sums_exactly(
    job: JobConfig, servers: list[RunningStageServer], tmp_path: Path
) -> None:
    a, b, c, _ = servers
    clients = [StageClient(s.address, job, fingerprint(job), STAGE) for s in servers]
    try:
        for index, client in enumerate(clients[:3]):
            await _microbatch(client, index, job)
        for index in (0, 1):  # the survivors' microbatches, in the pool's sum order
            await _microbatch(clients[3], index, job)
        _never_sums_its_own_part(c, hold_s=1.5)
        group = [s.address for s in (a, b, c)]
        first = await asyncio.gather(
            *(
                client.commit(
                    0,
                    [k],
                    12,
                    phase=pb.COMMIT_PHASE_PREPARE,
                    group=group,
                    group_index=k,
                    round="0/0",
                )
                for k, client in enumerate(clients[:3])
            ),
            return_exceptions=True,
        )
        assert all(isinstance(r, Aborted) for r in first), first
        for survivor in (a, b):  # its own part landed over its sums before the round died
            spill = survivor.runtime.sums.spill(0, None)
            assert spill is not None and spill.kept_bytes > 0
        assert os.listdir(tmp_path / "spill-0") == []  # kept in a file without a name
        await _survivors_commit(servers, clients)
    finally:
        for client in clients:
            await client.close()


@pytest.mark.parametrize("job", [60.0], indirect=True)  # no round here ends by its timeout
async def test_a_retry_after_a_round_called_off_half_way_applies_the_survivors_sums_exactly(
    job: JobConfig, servers: list[RunningStageServer]
) -> None:
    # The coordinator calls a round's PREPAREs off half way when the peer registry leaves one
    # of its members out (moved to another stage, or hung: `scheduler.coordinator.listed`):
    # each replica's call is cancelled, with its own part landed over its sums, while it waits
    # for the part the member left out never sums. The retry among the survivors is exact.
    a, b, c, _ = servers
    clients = [StageClient(s.address, job, fingerprint(job), STAGE) for s in servers]
    first: list[asyncio.Future[Any]] = []
    try:
        for index, client in enumerate(clients[:3]):
            await _microbatch(client, index, job)
        for index in (0, 1):
            await _microbatch(clients[3], index, job)
        _never_sums_its_own_part(c, hold_s=3600.0)
        group = [s.address for s in (a, b, c)]
        first += [
            asyncio.ensure_future(
                client.commit(
                    0,
                    [k],
                    12,
                    phase=pb.COMMIT_PHASE_PREPARE,
                    group=group,
                    group_index=k,
                    round="0/0",
                )
            )
            for k, client in enumerate(clients[:3])
        ]
        for survivor in (a, b):  # its own part lands over its sums; c's never comes
            await wait_until(lambda s=survivor: _kept_bytes(s) > 0, f"{survivor.address} kept")
        for call in first:
            call.cancel()
        await asyncio.gather(*first, return_exceptions=True)
        assert all(call.cancelled() for call in first)
        await _survivors_commit(servers, clients)
    finally:
        for call in first:
            call.cancel()  # a failed wait: the calls go before their channels
        await asyncio.gather(*first, return_exceptions=True)
        for client in clients:
            await client.close()


def _kept_bytes(running: RunningStageServer) -> int:
    spill = running.runtime.sums.spill(0, None)
    return 0 if spill is None else spill.kept_bytes


async def _survivors_commit(servers: list[RunningStageServer], clients: list[StageClient]) -> None:
    """The round again among the first two (round "0/1"), applied; each then equals the fourth
    replica, which committed their microbatches (0 and 1) alone."""
    a, b, _, alone = servers
    survivors = [a.address, b.address]
    await asyncio.gather(
        *(
            client.commit(
                0,
                [k],
                8,
                phase=pb.COMMIT_PHASE_PREPARE,
                group=survivors,
                group_index=k,
                round="0/1",
            )
            for k, client in enumerate(clients[:2])
        )
    )
    for client in clients[:2]:
        await client.commit(0, [], 8, phase=pb.COMMIT_PHASE_APPLY)
    await clients[3].commit(0, [0, 1], 8)
    expected = alone.runtime.state_dict()
    for survivor in (a, b):
        got = survivor.runtime.state_dict()
        assert survivor.runtime.step == 1
        for name, value in expected.items():
            assert torch.equal(got[name], value), name
