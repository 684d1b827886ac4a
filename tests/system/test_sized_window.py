"""Issue 53 item 5, end to end on the CPU: stage servers whose operator set their activation
cache's byte bound say in their load reports how many microbatches it holds (the job's
`activation_cache` here: the bound is roomy), the scheduler keeps it and passes it in its leases,
and its trainer's "auto" window is sized by it; the result is still `swarm local`'s (float64,
within 1e-9): a window never changes the maths."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from client.metrics import TrainerMetrics
from scheduler import job_training
from scheduler.job_training import final_path
from stage_server.peer.limits import PeerLimits
from swarm.job.config import parse_job
from tests.support.equality import assert_equal_to_local
from tests.support.jobs import BASE, render
from tests.support.scheduled import AMQTT_LEAKS, WAIT_S, scheduled_swarm
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.timeout(240), AMQTT_LEAKS]

HELD = 5  # the job's activation_cache: what a roomy bound holds
STEPS = 12  # long enough for the first load reports (every 0.2 s) to reach the trainer


async def test_a_window_sized_by_what_the_stages_hold_trains_swarm_locals_parameters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainers: list[TrainerMetrics] = []  # the embedded trainer's series, read here

    def kept(job_id: str) -> TrainerMetrics:
        trainers.append(TrainerMetrics(job_id))
        return trainers[-1]

    monkeypatch.setattr(job_training, "_trainer_metrics", kept)
    training = {**BASE["training"], "stages": 2, "steps": STEPS, "target_batch_size": 48}
    spec = render({**BASE, "training": training, "runtime": {"activation_cache": HELD}})
    roomy = PeerLimits(max_activation_cache_bytes=1 << 30)  # set by the operator: sized
    async with scheduled_swarm(tmp_path) as swarm:
        job = swarm.store.create("test", spec, str(tmp_path), STEPS).id
        swarm.scheduler.submitted(job)
        for name in ("a", "b"):
            await swarm.add(name, limits=roomy)

        def ended() -> bool:
            record = swarm.store.get(job)
            return record is not None and record.finished

        await wait_until(ended, "the job ends", timeout_s=WAIT_S * 3)
        record = swarm.store.get(job)
        assert record is not None and record.state == "succeeded", record
        registry = swarm.scheduler.peer_registry
        holds = {p: registry.capacity(p, job, s) for p, s in (("a", 0), ("b", 0), ("a", 1))}
    served = {p: h for p, h in holds.items() if h}
    assert list(served.values()) == [HELD], holds  # stage 0's replica said it; the last keeps none
    assert [t.window._value.get() for t in trainers] == [HELD]  # not 8, not the step's 12
    state = torch.load(final_path(tmp_path / "ckpt", job), weights_only=True)["state"]
    assert_equal_to_local(parse_job(spec, tmp_path, "test"), state)
