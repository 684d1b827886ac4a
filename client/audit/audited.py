"""The carry plane, audited: a wrapper (`Audited`) around a plane that runs a microbatch as it
always does, then reads what each stage was sent and answered from the plane's boundary cache
and has `Audits` check a sample of it, before the result is reported (a liar caught is banned
before its work commits). The plane itself builds nothing for the audit: it keeps its boundary
cache (`client.data_plane.boundary_cache`) as it would unaudited, and this module reads it
through the `Kept` seam. A microbatch the cache does not hold whole (a stage that answered
nothing the trainer holds, a rollback meanwhile) is not audited; neither is a replay from the
cache, which answers nothing of its own."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Protocol

import torch

from client.audit.audits import Audits, Work
from swarm.model.data import DataSource
from swarm.rpc.lease import MicrobatchResult, Replica, Task
from swarm.rpc.stage_client import TensorLike, WireCrossing

__all__ = ["Audited", "Kept", "Plane", "works_of"]


class Plane(Protocol):
    """The data plane being audited (`client.data_plane.plane.DataPlane`)."""

    def follow(self, replicas: Sequence[Sequence[Replica]]) -> None: ...
    async def stop(self) -> None: ...
    async def train(self, task: Task, data: DataSource) -> MicrobatchResult: ...
    async def evaluate(
        self, task: Task, ids: torch.Tensor, labels: torch.Tensor
    ) -> MicrobatchResult: ...


class Answer(Protocol):
    """What one stage answered (`client.data_plane.boundary_cache.Answer`)."""

    @property
    def forward_peer(self) -> str: ...
    @property
    def backward_peer(self) -> str: ...
    @property
    def grad_inputs(self) -> TensorLike | None: ...
    @property
    def loss_sum(self) -> float | None: ...


class Kept(Protocol):
    """What the audit reads of the plane's boundary cache (`BoundaryCache`)."""

    def get(self, step: int, index: int) -> dict[int, tuple[WireCrossing, TensorLike]] | None: ...
    def answers(self, step: int, index: int) -> Mapping[int, Answer]: ...
    def held(self, step: int, index: int) -> AbstractContextManager[None]: ...


class Audited:
    """`plane`, each microbatch it trains audited by `audits` from what `kept` holds of it."""

    def __init__(self, plane: Plane, kept: Kept, audits: Audits, stages: int) -> None:
        self.plane, self.kept, self.audits, self.last = plane, kept, audits, stages - 1

    def follow(self, replicas: Sequence[Sequence[Replica]]) -> None:
        self.plane.follow(replicas)

    async def stop(self) -> None:
        await self.plane.stop()  # its audits end before each microbatch's report

    async def evaluate(
        self, task: Task, ids: torch.Tensor, labels: torch.Tensor
    ) -> MicrobatchResult:
        return await self.plane.evaluate(task, ids, labels)  # nothing accumulates: no audit

    async def train(self, task: Task, data: DataSource) -> MicrobatchResult:
        step, index = task.step, task.index
        with self.kept.held(step, index):  # not forgotten for the budget before it is read
            result = await self.plane.train(task, data)
            works = works_of(self.kept, step, index, min(task.stages), self.last)
        if works is None:
            return result
        verdicts, runs, digests = await self.audits.audited(step, index, works, task.audits)
        return replace(
            result,
            verdicts=tuple(verdicts),
            stage_runs=len(works),
            audit_runs=runs,
            digests=tuple(digests),
        )


def works_of(kept: Kept, step: int, index: int, lowest: int, last: int) -> list[Work] | None:
    """What each stage from `lowest` to `last` of microbatch `(step, index)` was given and
    answered, as `kept` holds it (all, or None: an answer the trainer does not hold)."""
    sent, answers = kept.get(step, index), kept.answers(step, index)
    stages = range(lowest, last + 1)
    if sent is None or not all(k in sent and k in answers for k in stages):
        return None
    works = []
    for k in stages:
        given, grad_outputs = sent[k]
        answer = answers[k]
        outputs: TensorLike  # as they came: decoded where the work is audited
        if k == last:  # its outputs are the loss
            outputs = torch.tensor(answer.loss_sum, dtype=torch.float64)
        else:  # its outputs are what the stage above was sent
            outputs = sent[k + 1][0].hidden
        grad_inputs = answer.grad_inputs
        work = Work(
            k,
            given,
            grad_outputs,
            outputs,
            grad_inputs,
            answer.forward_peer,
            answer.backward_peer,
        )
        works.append(work)
    return works
