"""A joining replica's copy of a member (`stage_server.replica.copying.Copy`) whose source sends
what the stage would not load (a state or an update of the wrong shape): the copy refuses it where
it arrives, says which source, and this replica stays as it was, ready to copy another."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from stage_server.replica.copying import Copy
from stage_server.replica.runtime import StageRuntime
from swarm.errors import FailedPrecondition, InvalidArgument
from swarm.model.stage_state import initial_state
from swarm.rpc.stage_client import StageClient
from tests.support.hostile import HostileStage, serving
from tests.support.jobs import make_job
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

STAGE = 1  # of the tiny job: one transformer block


async def _now(method: Callable[..., Any], *args: Any) -> Any:
    return method(*args)  # the worker thread's stand-in: the test's loop has nothing else to do


async def _copied(source: HostileStage, runtime: StageRuntime) -> tuple[Copy, str]:
    """A copy of `source` into `runtime`, run until it ends, and the source's address."""
    async with serving(source) as address:
        client = StageClient(address, runtime.job, "job", STAGE)
        copy = Copy(client, runtime, _now, "joiner")
        await asyncio.wait_for(asyncio.gather(copy.task, return_exceptions=True), 30)
    assert not copy.task.cancelled()
    return copy, address


def _spoiled_sum(
    runtime: StageRuntime,
    spoiled: Callable[[torch.Tensor], torch.Tensor],
    honest: Callable[[torch.Tensor], torch.Tensor],
) -> Callable[[int], Iterator[tuple[int, int, torch.Tensor]]]:
    """A source's updates (`HostileStage`'s): gradient sum 3 `spoiled`, the others `honest`."""
    params = list(runtime.params)

    def updates(from_step: int) -> Iterator[tuple[int, int, torch.Tensor]]:
        for i, p in enumerate(params):
            yield from_step, i, spoiled(p) if i == 3 else honest(p)

    return updates


async def test_a_copy_refuses_a_source_whose_state_has_a_wrong_shape(tmp_path: Path) -> None:
    job = make_job(tmp_path)
    whole = initial_state(job, STAGE)
    name = next(iter(whole))
    spoiled = {**whole, name: torch.zeros(3, dtype=torch.float64)}
    runtime = StageRuntime(job, STAGE)
    before = {k: v.clone() for k, v in runtime.state_dict().items()}
    copy, address = await _copied(HostileStage(lambda: spoiled.items(), step=3), runtime)
    assert isinstance(copy.error, InvalidArgument), copy.task.exception()
    assert address in str(copy.error) and name in str(copy.error)
    assert not copy.loaded and not runtime.following and runtime.step == 0
    assert all(torch.equal(before[k], v) for k, v in runtime.state_dict().items())


async def test_a_copy_refuses_an_update_of_a_wrong_shape(tmp_path: Path) -> None:
    job = make_job(tmp_path)
    whole = initial_state(job, STAGE)
    runtime = StageRuntime(job, STAGE)
    updates = _spoiled_sum(runtime, lambda p: torch.zeros(7, dtype=p.dtype), torch.zeros_like)
    source = HostileStage(lambda: whole.items(), step=3, updates=updates)
    copy, address = await _copied(source, runtime)
    assert isinstance(copy.error, InvalidArgument), copy.task.exception()
    assert address in str(copy.error) and "gradient sum 3" in str(copy.error)
    assert copy.loaded and runtime.step == 3  # the state it took, and no update of it
    assert all(torch.equal(whole[f"param/{k}"], v) for k, v in runtime.state_dict().items())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
async def test_a_copy_refuses_a_state_that_is_not_finite(tmp_path: Path, bad: float) -> None:
    """A source's state with infinity (or NaN) in a parameter was loaded as sent: its NaN
    parameters were served, followed and promoted, and the job failed later naming its learning
    rate. It is refused, naming the source, and this replica stays as it was."""
    job = make_job(tmp_path)
    whole = initial_state(job, STAGE)
    name = next(k for k, v in whole.items() if k.startswith("param/") and v.numel() > 1)
    spoiled = {**whole, name: whole[name].clone().index_fill_(0, torch.tensor([0]), bad)}
    runtime = StageRuntime(job, STAGE)
    before = {k: v.clone() for k, v in runtime.state_dict().items()}
    copy, address = await _copied(HostileStage(lambda: spoiled.items(), step=3), runtime)
    assert isinstance(copy.error, InvalidArgument), copy.task.exception()
    assert address in str(copy.error) and "NaN or infinity" in str(copy.error), copy.error
    assert not copy.loaded and not runtime.following and runtime.step == 0
    assert all(torch.equal(before[k], v) for k, v in runtime.state_dict().items())


async def test_a_copy_refuses_an_update_that_is_not_finite(tmp_path: Path) -> None:
    """An update whose gradient sum is not finite was applied: the copy's parameters went NaN.
    It is refused before anything of it is applied, naming the source. (A scale that is not
    finite is refused as the update's header comes: `swarm.rpc.stream_order`.)"""
    job = make_job(tmp_path)
    whole = initial_state(job, STAGE)
    runtime = StageRuntime(job, STAGE)
    nan = _spoiled_sum(runtime, lambda p: torch.full_like(p, float("nan")), torch.ones_like)
    source = HostileStage(lambda: whole.items(), step=3, updates=nan)
    copy, address = await _copied(source, runtime)
    assert isinstance(copy.error, InvalidArgument), copy.task.exception()
    assert address in str(copy.error) and "NaN or infinity" in str(copy.error), copy.error
    assert copy.loaded and runtime.step == 3  # the state it took, and no update of it
    assert all(torch.equal(whole[f"param/{k}"], v) for k, v in runtime.state_dict().items())


async def test_a_copy_never_overwrites_a_replica_that_moved_while_it_downloaded(
    tmp_path: Path,
) -> None:
    # A Join that reached a member (a stale ask) started a copy; the member applied a commit
    # while the state downloaded: the copy, older than what the member holds, is not loaded.
    job = make_job(tmp_path)
    whole = initial_state(job, STAGE)
    runtime = StageRuntime(job, STAGE)

    def state() -> Iterator[tuple[str, torch.Tensor]]:
        runtime.commit(0, [], 16)  # the member's APPLY, as the download starts
        return iter(whole.items())

    copy, _ = await _copied(HostileStage(state, step=0), runtime)
    assert isinstance(copy.error, FailedPrecondition) and "stale" in str(copy.error), copy.error
    assert not copy.loaded and not runtime.following and runtime.step == 1
    assert not all(torch.equal(whole[f"param/{k}"], v) for k, v in runtime.state_dict().items())


async def test_a_copy_never_overwrites_a_rollback_that_loaded_while_it_downloaded(
    tmp_path: Path,
) -> None:
    """A joiner at step 0 began copying a member at step 5; a ban's rollback loaded step 0's
    state on it while the download ran (its step unchanged: 0), then the copy landed: the
    banned trajectory's state of step 5, over the rollback's (CI: test_ban_restart, "copied
    stage 0 at step 5" after "loaded stage 0's state of step 0 (a rollback)", and the replica
    refused every microbatch of the retrained steps as stale). A copy begun before a load is
    not loaded."""
    job = make_job(tmp_path)
    whole = initial_state(job, STAGE)
    runtime = StageRuntime(job, STAGE)
    rolled_back = {k: v.clone() for k, v in runtime.state_dict().items()}
    ahead = {k: v + 1 if v.is_floating_point() else v for k, v in whole.items()}

    def state() -> Iterator[tuple[str, torch.Tensor]]:
        runtime.load_state(0, whole)  # the rollback's load, as the download runs
        return iter(ahead.items())

    async with serving(HostileStage(state, step=5)) as address:
        copy = Copy(StageClient(address, job, "job", STAGE), runtime, _now, "joiner")
        try:  # until it ends, or loads (then it follows on: the old code's way)
            await wait_until(lambda: copy.loaded or not copy.running, "the copy's end or load")
            assert not copy.loaded and not runtime.following and runtime.step == 0
        finally:
            await copy.cancel()
    assert isinstance(copy.error, FailedPrecondition) and "stale" in str(copy.error), copy.error
    assert all(torch.equal(rolled_back[k], v) for k, v in runtime.state_dict().items())
