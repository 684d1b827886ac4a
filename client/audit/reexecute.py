"""A stage's work run again on a chosen replica, for an audit (`client.audit.audits`): the
same calls the carry plane makes, from the same bytes, with nothing accumulated. Not a hop (no
retry elsewhere, nothing fed to the wiring): the audit wants this replica's answer, or none."""

from __future__ import annotations

from collections.abc import Awaitable

import torch

from client.audit.audits import Redone, Work, decoded
from swarm.errors import ActivationsNotCached, PeerUnavailable
from swarm.job.config import JobConfig
from swarm.rpc.routes import Routes
from swarm.rpc.stage_client import BackwardResult, TensorLike, WireCrossing
from swarm.wire.off_loop import on_thread

__all__ = ["StageReexecutor", "decoded"]


class StageReexecutor:
    """Re-executes on the members the trainer's routes follow."""

    def __init__(self, job: JobConfig, routes: Routes) -> None:
        self.last, self.routes = job.training.stages - 1, routes

    def peers(self, stage: int) -> list[str]:
        clients = self.routes.clients  # their paths: a client is made only for a call
        return sorted(p for p in clients if (path := clients.path(p)) and path.stage == stage)

    async def redo(
        self, peer: str, step: int, index: int, work: Work, digest_seed: int = 0
    ) -> Redone:
        client = self.routes.clients.get(peer)
        if client is None:  # left the stage (banned by another trainer's audit) since drawn
            raise PeerUnavailable(f"{peer} is no longer a member of stage {work.stage}")
        grads = work.grad_inputs is not None  # asked for above the run's lowest stage only
        if work.stage == self.last:
            done = await client.forward_backward(
                step,
                index,
                work.given,
                work.grad_outputs,
                accumulate=False,
                need_grad_inputs=grads,
                digest_seed=digest_seed,
            )
            return Redone(
                torch.tensor(done.loss_sum, dtype=torch.float64),
                await _widened(done.grad_inputs),
                _digest(done),
            )
        outputs = await _widened(await client.forward(step, index, work.given))
        assert outputs is not None  # a forward's answer holds its outputs (`reply_checks`)

        def backward(given: WireCrossing | None) -> Awaitable[BackwardResult]:
            return client.backward(
                step,
                index,
                given,
                work.grad_outputs,
                accumulate=False,
                need_grad_inputs=grads,
                digest_seed=digest_seed,
            )

        try:  # its activations are cached there now
            back = await backward(None)
        except ActivationsNotCached:  # evicted meanwhile: send the inputs again
            back = await backward(work.given)
        return Redone(outputs, await _widened(back.grad_inputs), _digest(back))


async def _widened(value: TensorLike | None) -> torch.Tensor | None:
    """An auditor's answer decoded off the trainer's event loop: a microbatch's crossing, millions
    of values of a real model, and the loop is the one the trainer's every step runs on."""
    return None if value is None else await on_thread(lambda: decoded(value))


def _digest(done: BackwardResult) -> tuple[float, float, float] | None:
    d = done.digest
    return None if d is None else (d.dot, d.magnitude, d.norm)
