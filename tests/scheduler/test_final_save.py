"""The trained model's final save (issue 27, item 16): written as every checkpoint file is (fsynced,
whole or not at all); a save that fails keeps the job and its peers, says so in the job's status
line and tries again, so a full disk never throws a trained job away."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch

from scheduler.job_training import final_path, save_final
from scheduler.store import JobStore
from swarm.model import checkpoint
from tests.support.disks import fill, tiny_disk
from tests.support.inprocess import Swarm
from tests.support.job_training import job_training
from tests.support.jobs import make_job

STATE = {"w": torch.arange(64 * 1024, dtype=torch.float64)}  # 512 KiB: more than the disk has


def test_a_final_save_on_a_full_disk_fails_as_oserror_and_leaves_no_partial_file(
    tmp_path: Path,
) -> None:
    with tiny_disk(tmp_path / "disk", "256k") as disk:
        path = disk / "job" / "final.pt"
        fill(disk)
        with pytest.raises(OSError) as e:  # torch.save itself raises RuntimeError on ENOSPC
            save_final(path, 5, STATE)
        assert isinstance(e.value, checkpoint.CheckpointError) and str(path) in str(e.value)
        assert sorted(p.name for p in disk.rglob("*") if p.is_file()) == ["filler"]


@pytest.mark.parametrize("status", ["stored", "on a full disk"])
async def test_a_failed_final_save_keeps_the_job_and_its_peers_and_is_retried(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, status: str
) -> None:
    # "on a full disk": the status line's store is full too (its write raised sqlite3's own
    # error, which the retries did not catch: the save ended and the trained state went).
    training = {"stages": 2, "steps": 2, "target_batch_size": 4}  # one microbatch a step
    job = make_job(tmp_path, training=training, rebalance={"enabled": False})
    swarm = Swarm(job)
    said: list[str] = []
    disk = contextlib.ExitStack()
    full = None
    if status == "on a full disk":
        full = JobStore(disk.enter_context(tiny_disk(tmp_path / "disk")) / "status.sqlite")
        disk.callback(full.close)
        full_id = full.create(job.name, "", str(tmp_path), 2).id
        fill(tmp_path / "disk")

    async def set_status(job_id: str, state: Any, text: str) -> None:
        assert state in (None, "running"), f"the job was set {state}: {text}"
        said.append(text)
        if full is not None and state is None:
            full.set_message(full_id, text)

    with disk, JobStore(tmp_path / "jobs.sqlite") as store:
        job_id = store.create(job.name, "", str(tmp_path), job.training.steps).id
        final = final_path(tmp_path / "ckpt", job_id)
        final.mkdir(parents=True)  # the final name is taken: every save fails (EISDIR)
        training = job_training(store, swarm, tmp_path / "ckpt", set_status)
        training.final_save_retry_s = (0.01, 0.05)
        try:
            for stage in range(job.training.stages):
                server = await swarm.add(stage)
                server.servicer.serve(server.runtime, job_id)  # as the scheduler assigned it
            run = asyncio.create_task(training.run(job_id, job, []))
            async with asyncio.timeout(30):  # two failed attempts, or the run's end
                while sum("saving the final model failed" in s for s in said) < 2:
                    assert not run.done(), f"the run ended: {run.exception()!r}"
                    await asyncio.sleep(0.01)
            assert "retrying" in said[-1] and str(final) in said[-1], said[-1]
            assert job_id in training.coordinators, "the coordinator and its peers are kept"
            logged = [r.getMessage() for r in caplog.records if "final model" in r.getMessage()]
            assert logged and "errno EISDIR" in logged[0] and str(final) in logged[0], logged
            assert [p.name for p in final.parent.iterdir()] == ["final.pt"], "no partial file"
            final.rmdir()  # room for it now
            await asyncio.wait_for(run, 10)
            saved = torch.load(final, weights_only=True)
            stage0 = swarm.servers[0][0].runtime.export_state()
            assert saved["step"] == 2
            for name, value in stage0.items():
                if name.startswith("param/"):
                    assert torch.equal(saved["state"][name.removeprefix("param/")], value)
        finally:
            await swarm.close()
