"""A job's trained model downloaded from the test's own process, as `swarm export --out` writes it
(`SchedulerClient.export`, which the command calls): a `swarm export` process imports torch to
save the model, 4 to 6 s of CPU (10 s and more of wall on a busy 2-core machine) that a test
reading the model paid once more after the job had ended. The command itself is tested in
tests/client/test_cli.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from client.sdk import SchedulerClient

__all__ = ["exported_state"]


def exported_state(address: str, job_id: str, out: Path) -> dict[str, torch.Tensor]:
    """The model of `job_id` as the scheduler at `address` exports it, written to `out` (as
    `swarm export JOB --out OUT` writes it) and read back."""

    async def export() -> None:
        async with SchedulerClient(address) as client:
            await client.export(job_id, out)

    asyncio.run(export())
    state: dict[str, torch.Tensor] = torch.load(out, weights_only=True)
    return state
