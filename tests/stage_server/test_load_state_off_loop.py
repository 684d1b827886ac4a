"""A LoadState's tensors are decoded as every other received state is (`decode_named_async`):
lossy ones widened on a thread, not on the stage server's event loop (a standalone server's
caller may send them, up to `max_tensor_bytes` a message). A live stage server, a real call;
what that decode puts on a thread is its own tests' (tests/swarm/wire)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import stage_server.replica.state_transfer as state_transfer
from stage_server.server import RunningStageServer
from swarm.job.config import JobConfig
from swarm.rpc.stage_client import StageClient
from tests.support.middle_stage import MIDDLE

pytestmark = pytest.mark.timeout(60)


async def test_a_load_states_tensors_go_through_the_decode_for_an_event_loop(
    server: RunningStageServer, job: JobConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoded: list[int] = []
    async_decode = state_transfer.wire.decode_named_async

    def on_the_loop(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a LoadState decoded with the loop's decode_named")

    async def watched(*args: Any, **kwargs: Any) -> Any:
        tensors = await async_decode(*args, **kwargs)
        decoded.append(len(tensors))
        return tensors

    monkeypatch.setattr(state_transfer.wire, "decode_named", on_the_loop)
    monkeypatch.setattr(state_transfer.wire, "decode_named_async", watched)
    runtime = server.servicer.runtime
    state = {n: torch.zeros_like(t) for n, t in runtime.export_state(False).items()}
    client = StageClient(server.address, job, server.servicer.job_id, MIDDLE)
    try:
        assert await client.load_state(runtime.step, state) == runtime.step
    finally:
        await client.close()
    assert sum(decoded) == len(state)
    after = runtime.export_state(include_optimizer=False)
    assert all(torch.equal(after[n], state[n]) for n in state)
