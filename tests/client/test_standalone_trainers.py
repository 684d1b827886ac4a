"""`swarm trainer --stage-servers` with more than one trainer (`client.standalone`): one that
fails ends the others. They were gathered, and a gather that fails leaves its other awaitables
running: the other trainers went on leasing from the coordinator the failure had closed, and
dialling, until the process's loop was torn down (a review found it)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

import client.standalone
from client.standalone import train_standalone
from swarm.errors import SwarmError
from tests.support.inprocess import Swarm
from tests.support.jobs import make_job


class _Trainer:
    """Trainer 0 fails at its third turn; the others count their turns until cancelled."""

    turns: list[int] = []

    def __init__(self, job: Any, coordinator: Any, *, seed: int, **_: Any) -> None:
        self.seed, self.failure = seed, None

    async def run(self) -> None:
        for turn in range(10_000):
            await asyncio.sleep(0.01)
            if self.seed == 0 and turn == 2:
                raise SwarmError("trainer 0 broke")
            if self.seed:
                _Trainer.turns.append(turn)

    async def close(self) -> None:
        pass


async def test_a_failing_trainer_ends_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = make_job(tmp_path, training={"stages": 1, "steps": 100})
    swarm = Swarm(job)
    monkeypatch.setattr(client.standalone, "PipelineTrainer", _Trainer)
    _Trainer.turns = []
    try:
        await swarm.add(0)
        with pytest.raises(SwarmError, match="trainer 0 broke"):
            await train_standalone(job, swarm.members, trainers=2)
        after = len(_Trainer.turns)
        await asyncio.sleep(0.2)
    finally:
        await swarm.close()
    assert len(_Trainer.turns) == after, "the other trainer went on after the failure"
