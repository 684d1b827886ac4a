"""A hostile replica's lies (`swarm.ops.poison`: tests, benchmarks and `SWARM_FAULTS`), installed
once, at the servicer's start, as wrappers: `Lying` over the replica's compute (what it computes
and what it says it computed: its outputs, input gradients and an audit's digests) and
`LyingHop` over its next hop on the push plane (`poison-sent-outputs`: it commits to the honest
outputs and sends others).

An honest replica installs `HONEST`, which wraps nothing: its calls reach `StageRuntime` and
`NextHop` themselves, and no poison code runs on its path (issue 66: the lies were once hooks
that every Forward, Backward and Push called)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

import torch

from stage_server.replica.handing import Outgoing
from stage_server.replica.next_hop import Hop, Onward, Pushed
from stage_server.replica.runtime import Receipt
from swarm.ops.poison import Poison
from swarm.rpc.stage_client import TensorLike
from swarm.wire import codec

__all__ = ["HONEST", "Compute", "Honest", "Liar", "Lies", "Lying", "LyingHop", "lies_of"]


class Compute(Protocol):
    """What a replica computes for the calls it serves: `StageRuntime`'s methods of those
    names (their arguments are its; the calls go through `Worker.run_then`, which takes any)."""

    @property
    def forward(self) -> Callable[..., torch.Tensor]: ...

    @property
    def backward(self) -> Callable[..., tuple[torch.Tensor | None, Receipt]]: ...

    @property
    def forward_backward(self) -> Callable[..., tuple[float, torch.Tensor | None, Receipt]]: ...

    @property
    def evaluate(self) -> Callable[..., float]: ...


class Lies(Protocol):
    """What a replica installs over its compute and its next hop when it serves a stage."""

    def compute(self, compute: Compute) -> Compute: ...

    def hop(self, hop: Hop) -> Hop: ...


class Honest:
    """An honest replica's: its compute and its next hop as they are."""

    def compute(self, compute: Compute) -> Compute:
        return compute

    def hop(self, hop: Hop) -> Hop:
        return hop


HONEST = Honest()


class Liar:
    """A hostile replica's: its compute and next hop each wrapped to lie as `poison` says."""

    def __init__(self, poison: Poison) -> None:
        self.poison = poison

    def compute(self, compute: Compute) -> Compute:
        return Lying(compute, self.poison)

    def hop(self, hop: Hop) -> Hop:
        return LyingHop(hop, self.poison)


def lies_of(poison: Poison) -> Lies:
    """`HONEST` where `poison` lies about nothing, else a `Liar`."""
    return Liar(poison) if poison.faults else HONEST


class Lying:
    """`compute`, its outputs, input gradients and digests as `poison` says (the rest honest).
    Each call's first argument is its microbatch's step, as `StageRuntime`'s."""

    def __init__(self, compute: Compute, poison: Poison) -> None:
        self._compute, self.poison = compute, poison

    def forward(self, step: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.poison.outputs(step, self._compute.forward(step, *args, **kwargs))

    def backward(self, step: int, *args: Any, **kwargs: Any) -> tuple[torch.Tensor | None, Receipt]:
        grad, receipt = self._compute.backward(step, *args, **kwargs)
        return self.poison.grads(step, grad), self._said(receipt)

    def forward_backward(
        self, step: int, *args: Any, **kwargs: Any
    ) -> tuple[float, torch.Tensor | None, Receipt]:
        loss, grad, receipt = self._compute.forward_backward(step, *args, **kwargs)
        return loss, self.poison.grads(step, grad), self._said(receipt)

    def evaluate(self, step: int, *args: Any, **kwargs: Any) -> float:
        return self._compute.evaluate(step, *args, **kwargs)

    def _said(self, receipt: Receipt) -> Receipt:
        """`receipt` with the digest this replica answers an audit with."""
        return replace(receipt, digest=self.poison.digest(receipt.step, receipt.digest))


class LyingHop:
    """`hop`, sending outputs other than those its replica committed to where `poison` says
    (`poison-sent-outputs`): the record made beside the forward holds the honest message, the
    next stage gets it plus the poison's error, re-encoded as it was. Validation microbatches
    go on as they are (no record, nothing to lie against)."""

    def __init__(self, hop: Hop, poison: Poison) -> None:
        self._hop, self.poison = hop, poison

    async def send(self, call: Onward, *, deadline: float) -> Pushed:
        forged = None if call.evaluate else self._forged(call)
        sent = call if forged is None else call.carrying(forged)
        return await self._hop.send(sent, deadline=deadline)

    def _forged(self, call: Onward) -> TensorLike | None:
        hidden = call.crossing.hidden
        honest = hidden.wire() if isinstance(hidden, Outgoing) else hidden
        if isinstance(honest, torch.Tensor):  # the stage client encodes it as it goes
            return self.poison.sent(call.step, honest)
        wrong = self.poison.sent(call.step, codec.decode(honest))
        if wrong is None:
            return None
        # the honest message's codec, and its block where that codec has one (else the default)
        if honest.block_size:
            return codec.encode(wrong, honest.name, honest.codec, honest.block_size)
        return codec.encode(wrong, honest.name, honest.codec)

    async def close(self) -> None:
        await self._hop.close()
