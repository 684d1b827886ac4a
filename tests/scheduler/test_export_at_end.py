"""`swarm export` as the job ends: the scheduler took the job's live coordinator for the download,
and the job's end (its final model saved, its coordinator closed, its stage servers released)
overtakes the download. The export answers with the saved final model: the user asked for the
model, and it is there. (Before, the download failed on the closed connections, or on servers
that had let the job go: "no replica of stage 0 gave its state: ['peer0: PeerUnavailable']", seen
in a system test that exported a job the moment its status said the last step.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import scheduler.service
from scheduler.coordinator import LocalCoordinator, gather_model
from scheduler.job_training import final_path
from tests.support.jobs import BASE, render
from tests.support.scheduled import AMQTT_LEAKS, WAIT_S, scheduled_swarm
from tests.support.waiting import wait_until

pytestmark = [AMQTT_LEAKS, pytest.mark.timeout(120)]

STEPS = 12


async def test_an_export_overtaken_by_the_jobs_end_answers_with_the_final_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = render({**BASE, "training": {**BASE["training"], "stages": 2, "steps": STEPS}})
    async with scheduled_swarm(tmp_path) as swarm:
        job = swarm.store.create("test", spec, str(tmp_path), STEPS).id

        def ended() -> bool:
            record = swarm.store.get(job)
            return record is not None and record.finished

        async def overtaken(coordinator: LocalCoordinator) -> object:
            # The download starts with the job's coordinator in hand, and runs once the job
            # has ended under it.
            await wait_until(ended, "the job ends", timeout_s=WAIT_S)
            return await gather_model(coordinator)

        monkeypatch.setattr(scheduler.service, "gather_model", overtaken)
        swarm.scheduler.submitted(job)
        for name in ("a", "b"):
            await swarm.add(name)
        await wait_until(lambda: swarm.step(job) >= 1, "the job trains", timeout_s=WAIT_S)
        assert not ended()  # the export below takes the live coordinator, not the saved file

        step, state = await swarm.scheduler.export(job)

        record = swarm.store.get(job)
        assert record is not None and record.state == "succeeded", record
        saved = torch.load(final_path(tmp_path / "ckpt", job), weights_only=True)
        assert step == STEPS == saved["step"]
        assert state.keys() == saved["state"].keys()
        assert all(torch.equal(state[name], saved["state"][name]) for name in state)
