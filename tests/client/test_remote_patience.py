"""A remote trainer (`swarm trainer --scheduler`) whose every microbatch fails stops after the
job's `runtime.patience_s`, naming its last failure: cut off from one stage (a firewall), it
retried for ever, and the job, trained on by the scheduler's other trainers, never said so (a
review found it). One that only waits for work (the job stalled for its own reasons) waits on."""

from __future__ import annotations

import asyncio
import time

import pytest

from client.patience import NoProgress
from client.remote import run_patiently
from swarm.deadline import within

REFUSAL = "UNAVAILABLE: failed to connect to 10.0.0.7:7701 (stage 1)"


class _Trainer:
    """Tries a microbatch every 10 ms: each fails with `failure` while `failing`."""

    def __init__(self, failure: str | None, failing: bool = True) -> None:
        self.failure, self.failing, self.turns = failure, failing, 0
        self.failed_at = time.monotonic()

    async def run(self) -> None:
        while True:
            self.turns += 1
            if self.failing:
                self.failed_at = time.monotonic()
            await asyncio.sleep(0.01)


async def test_a_trainer_whose_every_microbatch_fails_stops_naming_the_cause() -> None:
    trainer = _Trainer(REFUSAL)
    with pytest.raises(NoProgress) as stopped:
        await within(run_patiently(trainer, 0.3, quiet_s=0.2), 5.0)
    assert str(stopped.value) == (
        "no microbatch of this trainer went through for 0.3 s (runtime.patience_s); the last "
        f"failure: {REFUSAL}"
    )
    turns = trainer.turns
    await asyncio.sleep(0.05)
    assert trainer.turns == turns  # stopped


@pytest.mark.parametrize("failure", [None, REFUSAL])
async def test_a_trainer_waiting_for_work_waits_on(failure: str | None) -> None:
    """Nothing failed, or its last failure is old: a stage lost its replica, say, and the job
    hands out no work meanwhile (a review found the trainer stopping there)."""
    trainer = _Trainer(failure, failing=False)
    running = asyncio.create_task(run_patiently(trainer, 0.3, quiet_s=0.2))
    await asyncio.sleep(1.0)
    assert not running.done()
    running.cancel()
    await asyncio.gather(running, return_exceptions=True)
