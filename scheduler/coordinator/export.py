"""The whole model at one step, from the replicas: what `swarm export`, the end of a job and the
standalone trainer take."""

from __future__ import annotations

import torch

from scheduler.coordinator.coordinator import LocalCoordinator
from swarm.errors import FailedPrecondition, SwarmError
from swarm.policy.backoff import Backoff
from swarm.rpc.lease import Replica

__all__ = ["gather_model", "gather_state"]


async def gather_model(
    coordinator: LocalCoordinator, attempts: int = 5
) -> tuple[int, dict[str, torch.Tensor]]:
    """The whole model at one step, and that step: each stage from the first of its replicas
    that answers. Every stage must be at the same step (at the job's last one once training
    is over); a commit landing between two downloads means downloading again."""
    want = coordinator.steps if coordinator.ledger is None else None
    steps: set[int] = set()
    backoff = Backoff(first_s=0.1, cap_s=2.0)
    for _ in range(attempts):
        steps, state = set(), {}
        for stage, replicas in enumerate(coordinator.replicas()):
            step, part = await _download(coordinator, stage, replicas, want)
            steps.add(step)
            state.update(part)
        if len(steps) == 1:
            return steps.pop(), state
        await backoff.sleep()
    raise FailedPrecondition(f"the stages are at steps {sorted(steps)}: no whole model to take")


async def _download(
    coordinator: LocalCoordinator, stage: int, replicas: list[Replica], want: int | None
) -> tuple[int, dict[str, torch.Tensor]]:
    problems = []
    for replica in replicas:
        try:
            step, part = await coordinator.client(stage, replica).download_state()
        except SwarmError as e:
            problems.append(f"{replica.peer}: {type(e).__name__}: {str(e)[:200]}")  # its cause
            continue
        if want is None or step == want:
            return step, part
        problems.append(f"{replica.peer} is at step {step}, not {want}")
    raise FailedPrecondition(f"no replica of stage {stage} gave its state: {problems}")


async def gather_state(coordinator: LocalCoordinator) -> dict[str, torch.Tensor]:
    """`gather_model`'s model alone."""
    return (await gather_model(coordinator))[1]
