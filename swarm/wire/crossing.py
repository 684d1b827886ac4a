"""What crosses a stage boundary, as one value: the hidden state (a stage's outputs, the next
one's inputs; the first stage's inputs are the token ids themselves) and, where the job's
boundary needs them beside it, the microbatch's token ids (`swarm.model.boundary`).

The token ids once travelled as a keyword of their own beside the inputs, through every call of
the stage client, the carry plane, its boundary cache and audits, the next hop and the replica's
runtime (issue 66): a new kind of boundary would have widened each of them again. A `Crossing`
is made once, where the boundary is known (`Boundary.tokens`: the trainer's carry plane, a first
stage's replica on the push plane), and passed on whole.

Generic in the hidden state's form and the ids': the trainer and the stage client hold messages
they pass on untouched (`swarm.rpc.stage_client.WireCrossing`), the replica decoded tensors
(`stage_server.replica.tensor_checks.Given`), and a replica's next hop its outputs as it hands
them on (`stage_server.replica.handing.Outgoing`) beside the ids' message."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["Crossing"]

H = TypeVar("H", covariant=True)  # the hidden state's form (read only: a frozen value)
K = TypeVar("K", covariant=True)  # the token ids'
G = TypeVar("G")
L = TypeVar("L")


@dataclass(frozen=True)
class Crossing(Generic[H, K]):
    """`hidden`, and the token ids that go with it (`tokens`; None: the boundary needs none, or
    this is the first stage's input, whose hidden state is the ids)."""

    hidden: H
    tokens: K | None = None

    def carrying(self, hidden: G) -> Crossing[G, K]:
        """The same crossing with `hidden` in place of its hidden state (the next stage's, made
        from this one's: the token ids go on as they came)."""
        return Crossing(hidden, self.tokens)

    def tokens_as(self, form: Callable[[K], L]) -> Crossing[H, L]:
        """The same crossing with its token ids (where it has any) in another `form`: encoded
        to be passed on, say."""
        return Crossing(self.hidden, None if self.tokens is None else form(self.tokens))
