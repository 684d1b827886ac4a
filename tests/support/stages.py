"""One fake stage for the unit tests of both data planes and of the push plane's next hop: a
replica that answers at once and accumulates what it is asked to, behind the `ClientFactory`
seam (`swarm.rpc.routes`) that the trainer and a replica's next hop both build clients through.
`FakeCalls` records every call and holds the faults to raise on the next accumulating calls at a
stage (`after`: once the replica accumulated, as a replica that died before answering would)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from swarm.device.handover import Offer
from swarm.job.config import JobConfig
from swarm.proto import stage_pb2 as pb
from swarm.proto import tensor_pb2
from swarm.rpc.stage_client import (
    BackwardResult,
    PushResult,
    TensorLike,
    WireCrossing,
    WirePush,
)
from swarm.wire import codec

__all__ = ["LOSS", "Call", "FakeCalls", "FakeStage"]

LOSS = 7.5  # every microbatch's loss sum at the last stage


@dataclass(frozen=True)
class Call:
    peer: str
    stage: int
    method: str  # "forward", "backward", "forward_backward" or "push"
    accumulate: bool = False
    need_grad_inputs: bool = False


@dataclass
class FakeCalls:
    """What the fake replicas saw: every call, what each one accumulated, and the faults to
    raise on the next accumulating calls at a stage (`after`: once the replica accumulated), or
    on the next calls of any kind (`busy`, say) with `fail_next`."""

    calls: list[Call] = field(default_factory=list)
    accumulated: dict[int, list[str]] = field(default_factory=dict)  # stage -> replicas
    faults: dict[int, list[tuple[Exception, bool]]] = field(default_factory=dict)
    refusals: dict[str, list[Exception]] = field(default_factory=dict)  # peer -> next errors
    sites: dict[str, str] = field(default_factory=dict)  # peer -> the handover site it answers
    pushed: list[tuple[str, TensorLike, Offer | None]] = field(default_factory=list)  # inputs

    def fail(self, stage: int, error: Exception, *, after: bool) -> None:
        self.faults.setdefault(stage, []).append((error, after))

    def fail_next(self, peer: str, error: Exception) -> None:
        self.refusals.setdefault(peer, []).append(error)

    def at(self, stage: int, method: str) -> list[Call]:
        return [c for c in self.calls if c.stage == stage and c.method == method]

    def accumulating(self, stage: int) -> list[Call]:
        return [c for c in self.calls if c.stage == stage and c.accumulate]

    def factory(self) -> FakeFactory:
        """A `ClientFactory` of fake stages recording here (the address names the peer)."""
        return FakeFactory(self)


@dataclass
class FakeFactory:
    calls: FakeCalls

    def __call__(
        self,
        address: str,
        job: JobConfig,
        job_id: str,
        stage: int,
        token: str | None,
        /,
        *,
        direct: bool = False,
    ) -> FakeStage:
        return FakeStage(self.calls, address, stage)


def _tensor(name: str) -> tensor_pb2.Tensor:
    return codec.encode(torch.zeros(2, dtype=torch.float64), name)


class FakeStage:
    """A replica of one stage: answers at once, accumulates what it is asked to."""

    def __init__(self, calls: FakeCalls, peer: str, stage: int) -> None:
        self.swarm, self.peer, self.address, self.stage = calls, peer, peer, stage
        self.last_queued_s = 0.0

    async def close(self) -> None:
        pass

    def _refused(self) -> None:
        pending = self.swarm.refusals.get(self.peer)
        if pending:
            raise pending.pop(0)

    async def forward(
        self,
        step: int,
        index: int,
        crossing: WireCrossing,
        *,
        evaluate: bool = False,
    ) -> tensor_pb2.Tensor:
        self.swarm.calls.append(Call(self.peer, self.stage, "forward"))
        self._refused()
        return _tensor("outputs")

    async def evaluate(
        self,
        step: int,
        index: int,
        crossing: WireCrossing,
        targets: TensorLike,
    ) -> float:
        self.swarm.calls.append(Call(self.peer, self.stage, "evaluate"))
        self._refused()
        return LOSS

    def _accumulate(self, stages: Sequence[int], method: str, need_grad_inputs: bool) -> None:
        """Record the call; raise a fault planned for its stage, before or after accumulating
        at `stages` (the stages the call asked to accumulate at)."""
        self.swarm.calls.append(Call(self.peer, self.stage, method, bool(stages), need_grad_inputs))
        self._refused()
        faults = self.swarm.faults.get(self.stage) if stages else None
        error, after = faults.pop(0) if faults else (None, False)
        if error is not None and not after:
            raise error  # refused: nothing accumulated
        for stage in stages:
            self.swarm.accumulated.setdefault(stage, []).append(self.peer)
        if error is not None:
            raise error  # accumulated, and then the answer never came

    def _backprop(
        self, method: str, step: int, index: int, accumulate: bool, need_grad_inputs: bool
    ) -> BackwardResult:
        self._accumulate([self.stage] if accumulate else [], method, need_grad_inputs)
        grad = _tensor("grad_inputs") if need_grad_inputs else None
        loss = LOSS if method == "forward_backward" else 0.0
        return BackwardResult(grad, pb.Receipt(), loss, 0.0)

    async def backward(
        self,
        step: int,
        index: int,
        crossing: WireCrossing | None,
        grad_outputs: TensorLike,
        *,
        accumulate: bool = True,
        need_grad_inputs: bool = True,
    ) -> BackwardResult:
        return self._backprop("backward", step, index, accumulate, need_grad_inputs)

    async def forward_backward(
        self,
        step: int,
        index: int,
        crossing: WireCrossing,
        targets: TensorLike,
        *,
        accumulate: bool = True,
        need_grad_inputs: bool = True,
    ) -> BackwardResult:
        return self._backprop("forward_backward", step, index, accumulate, need_grad_inputs)

    async def push(
        self, call: WirePush, *, timeout: float | None = None, reply: Offer | None = None
    ) -> PushResult:
        """As if this stage and every one after it (the rest of `call.route`) ran the
        microbatch: it accumulates at every stage of `call.accumulate`, each receipt named by
        this peer. Its inputs and the caller's slot for the gradient (`reply`) are kept in
        `pushed`."""
        step, index, accumulate = call.step, call.index, call.accumulate
        self.swarm.pushed.append((self.peer, call.crossing.hidden, reply))
        self._accumulate(list(accumulate), "push", call.need_grad_inputs)
        receipts = [
            pb.Receipt(peer=self.peer, stage=k, microbatch=pb.MicrobatchId(step=step, index=index))
            for k in accumulate
        ]
        grad = _tensor("grad_inputs") if call.need_grad_inputs else None
        return PushResult(
            grad, receipts, set(), LOSS, 0.0, site=self.swarm.sites.get(self.peer, "")
        )
