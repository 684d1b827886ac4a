"""A job's standbys as the scheduler sets them up (`JobTraining._stand_by`, issue 67): the
default ("auto") only where a peer the job does not need has room, by number otherwise; none
under pool rounds, with a warning only where the job asked for some by number."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from scheduler.store import JobStore
from tests.support.inprocess import Swarm
from tests.support.job_training import job_training
from tests.support.jobs import make_job

LOCAL = {"mode": "local", "sync_every": 2}


async def _standbys(tmp_path: Path, **sections: Any) -> Any:
    job = make_job(tmp_path, **sections)

    async def set_status(job_id: str, state: Any, text: str) -> None:
        pass

    with JobStore(tmp_path / "jobs.sqlite") as store:
        training = job_training(store, Swarm(job), tmp_path / "ckpt", set_status)
        told = SimpleNamespace(committed=None, rolled_back=None, status=None, banned=None)
        coordinator = training._coordinator("j", job, told, None)  # type: ignore[arg-type]
        try:
            return coordinator.membership.standbys
        finally:
            await coordinator.close()


async def test_the_default_stands_by_only_where_a_spare_has_room(tmp_path: Path) -> None:
    standbys = await _standbys(tmp_path)
    assert (standbys.wanted, standbys.only_spares) == (1, True)
    asked = await _standbys(tmp_path, runtime={"standby": 2})
    assert (asked.wanted, asked.only_spares) == (2, False)


async def test_pool_rounds_take_none_and_warn_only_where_asked_by_number(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="scheduler.job_training"):
        standbys = await _standbys(tmp_path, pool=LOCAL)
    assert standbys.wanted == 0
    assert "runtime.standby" not in caplog.text  # the default: nobody asked
    with caplog.at_level(logging.WARNING, logger="scheduler.job_training"):
        asked = await _standbys(tmp_path, pool=LOCAL, runtime={"standby": 1})
    assert asked.wanted == 0
    assert "runtime.standby = 1: none under pool rounds" in caplog.text
