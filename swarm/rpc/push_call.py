"""One microbatch on the push data plane, as one value: what a trainer sends to a replica of the
first stage (`client.data_plane.push`), what that replica serves (`stage_server.replica.push`)
and what it sends on to the next stage (`stage_server.replica.next_hop`), through the stage
client (`StageClient.push`) each time.

Each issue that widened the push plane once added keywords to all of these (the token ids, a
handover's slot, an audit's run; issue 66): the call is now one `PushCall`, and what is the
call's own (the microbatch, what crosses, where it goes, what comes back) stays apart from what
is one try's (its deadline, a co-located caller's slot), which the stage client takes beside it.

The rollback epoch is not in it: the stage client stamps every call with the current task's
(`swarm.rpc.epoch`), and a replica sets its task's from the call it serves."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Generic, TypeVar

from swarm.job.config import JobConfig
from swarm.proto import stage_pb2 as pb
from swarm.wire.crossing import Crossing

__all__ = ["PushCall", "push_deadline_s"]

H = TypeVar("H", covariant=True)  # the form of the hidden state that crosses (read only)
K = TypeVar("K", covariant=True)  # of the token ids and the targets
G = TypeVar("G")
L = TypeVar("L")


@dataclass(frozen=True)
class PushCall(Generic[H, K]):
    """Microbatch `(step, index)`: its `crossing` into the receiving stage and its `targets`,
    accumulated at the stages in `accumulate` (the receiver's and later ones), through the
    replicas `route` names (one `Route` per stage after the receiver's)."""

    step: int
    index: int
    crossing: Crossing[H, K]
    targets: K
    accumulate: tuple[int, ...] = ()
    route: tuple[pb.Route, ...] = ()
    need_grad_inputs: bool = False  # the gradient of `crossing.hidden` is wanted back
    evaluate: bool = False  # a validation microbatch: its loss back, nothing kept
    run: int = 0  # its run's records at each replica (0: none kept; `push_records`)

    @staticmethod
    def received(h: pb.StagePushRequest, crossing: Crossing[G, L], targets: L) -> PushCall[G, L]:
        """The call `h` asked for, with its tensors as they came."""
        return PushCall(
            h.microbatch.step,
            h.microbatch.index,
            crossing,
            targets,
            accumulate=tuple(h.accumulate),
            route=tuple(h.route),
            need_grad_inputs=h.need_grad_inputs,
            evaluate=h.evaluate,
            run=h.run,
        )

    def onward(
        self, crossing: Crossing[G, L], targets: L, *, after: int, need_grad_inputs: bool
    ) -> PushCall[G, L]:
        """The call stage `after` (the receiver) sends on to the next: its outputs' `crossing`
        and the `targets` as it passes them on, accumulated at the later stages this call
        accumulates at, through the same route (`route[0]`: the next stage's replicas)."""
        return PushCall(
            self.step,
            self.index,
            crossing,
            targets,
            accumulate=tuple(k for k in self.accumulate if k > after),
            route=self.route,
            need_grad_inputs=need_grad_inputs,
            evaluate=self.evaluate,
            run=self.run,
        )

    def carrying(self, hidden: G) -> PushCall[G, K]:
        """The same call with `hidden` in place of the crossing's hidden state (one try's
        form of it: handed over, or on the wire)."""
        return PushCall(
            self.step,
            self.index,
            self.crossing.carrying(hidden),
            self.targets,
            accumulate=self.accumulate,
            route=self.route,
            need_grad_inputs=self.need_grad_inputs,
            evaluate=self.evaluate,
            run=self.run,
        )

    def trying(self, accumulating: bool) -> PushCall[H, K]:
        """As one try sends it: accumulated only where the hop lets this try accumulate (an
        earlier try may have: this one then only fetches what comes back)."""
        return self if accumulating else replace(self, accumulate=())

    def past(self, accumulating: bool) -> PushCall[H, K]:
        """As a replica sends it on to one of `route[0]`'s replicas: the route after them, and
        accumulated as `trying` says."""
        return replace(self.trying(accumulating), route=self.route[1:])


def push_deadline_s(job: JobConfig) -> float:
    """A trainer's deadline for one push, its whole path: `rpc_timeout_s` a stage. Its replicas'
    computes end by then or soon after (one running as it passes runs on: the late-receipt
    check waits for it that long)."""
    return job.runtime.rpc_timeout_s * job.training.stages
