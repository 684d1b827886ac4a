"""The ordering rules of a replica's state and update streams (`swarm.rpc.state_streams`): which
message may follow which, judged from the headers alone. Pure: no I/O, no gRPC; a refusal is an
`OutOfOrder` whose text says what was sent, which the stream prefixes with its sender.

A state is one step's, each tensor once, at most the stage's count of them. An update stream
(what a follower applies, `stage_server.replica.following.Following.apply`) is a sequence of
updates, each carried by one or more messages of its gradient sums in parameter order:

- it starts at the step the follower asked from, or later;
- a plain update of step s moves the sender to s + 1: the next update is of s + 1;
- under a rule with rounds, a round's end at step s (`round_end`) comes before that step's own
  update, which follows it at s; a second round end at s does not;
- its eager operation (pool.overlap = "eager") is STEP or AVERAGE or none; an AVERAGE, and only
  an AVERAGE, names the round it ends (0 < boundary <= step), and may arrive at any point (the
  pool's sum, whenever it came: it moves no step);
- without rounds a `round_end` is a plain update, and an update takes at least one sample
  (a local step may take none); its clipping coefficient is in (0, 1];
- a message that continues an update carries its step, samples and coefficient; the sums are
  numbered 0, 1, ... in order, and the stream ends with its last update whole.
"""

from __future__ import annotations

from typing import NamedTuple

from swarm.job.rule import EagerOp

__all__ = ["OutOfOrder", "StateOrder", "UpdateHeader", "UpdateOrder"]


class OutOfOrder(ValueError):
    """A message the stream's order does not admit; the text says what was sent."""


class StateOrder:
    """A state stream's order: every tensor of one step, each name once, at most `most`."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.names: set[str] = set()
        self.step = -1  # none came yet

    def message(self, step: int) -> None:
        """A message of `step` came."""
        if self.step >= 0 and step != self.step:
            raise OutOfOrder(f"a state of step {self.step}, then of step {step}")
        self.step = step

    def tensor(self, name: str, stage: int) -> None:
        """Tensor `name` of stage `stage`'s state came."""
        if name in self.names:
            raise OutOfOrder(f"{name!r} twice")
        if len(self.names) == self.most:
            raise OutOfOrder(f"more than the {self.most} tensors stage {stage} has")
        self.names.add(name)


class UpdateHeader(NamedTuple):
    """What an update message's header says of its update (the wire's values, unjudged)."""

    step: int
    total_samples: int
    scale: float = 1.0  # the clipping coefficient
    round_end: bool = False
    eager: int = EagerOp.NONE
    boundary: int = 0  # an AVERAGE's round (its end)


class UpdateOrder:
    """An update stream's order (the module's rules), one message at a time: `message` for each
    header, `sum` for each gradient sum's name in it, `end` once the stream ended."""

    def __init__(self, from_step: int, *, rounds: bool, sums: int) -> None:
        self.from_step, self.rounds, self.sums = from_step, rounds, sums
        self.current: UpdateHeader | None = None  # the update the last message was of
        self.count = 0  # its sums that came
        # the step the sender is at after the last update, and whether a round ended there
        self.at, self.ended = -1, False

    def message(self, header: UpdateHeader) -> UpdateHeader | None:
        """The update a message begins (its header as judged: `round_end` only with rounds,
        `eager` an `EagerOp`, `boundary` -1 but for an AVERAGE), or None where it continues
        the update before, which is not whole yet."""
        last = self.current
        if last is not None and self.count != self.sums:
            if header[:3] != last[:3]:
                raise OutOfOrder(
                    f"the update of step {last.step} with {self.count} of {self.sums} sums"
                )
            return None
        self.current, self.count = self._begin(header, first=last is None), 0
        return self.current

    def _begin(self, header: UpdateHeader, *, first: bool) -> UpdateHeader:
        step, samples, scale = header.step, header.total_samples, header.scale
        end = header.round_end and self.rounds
        eager = header.eager if end else EagerOp.NONE
        average = eager == EagerOp.AVERAGE
        if eager not in (EagerOp.NONE, EagerOp.STEP, EagerOp.AVERAGE) or average != (
            0 < header.boundary <= step
        ):
            raise OutOfOrder(
                f"an update of step {step} with eager operation {header.eager} "
                f"of the round ending at {header.boundary}"
            )
        if first:
            in_order = step >= self.from_step
        else:
            in_order = step == self.at and not (end and not average and self.ended)
        if not in_order:
            raise OutOfOrder(f"an update of step {step} out of order")
        if samples < (0 if self.rounds else 1) or not 0.0 < scale <= 1.0:
            raise OutOfOrder(f"an update of {samples} samples with coefficient {scale}")
        if not end:
            self.at, self.ended = step + 1, False
        elif not average:
            self.at, self.ended = step, True
        elif first:
            self.at = step
        boundary = header.boundary if average else -1
        return UpdateHeader(step, samples, scale, end, EagerOp(eager), boundary)

    def sum(self, name: str) -> int:
        """The index of the gradient sum `name` came as: the next one due."""
        if name != str(self.count):
            raise OutOfOrder(f"gradient sum {name!r} where {self.count} was due")
        self.count += 1
        return self.count - 1

    def end(self) -> None:
        """The stream ended: its last update must be whole."""
        if self.current is not None and self.count != self.sums:
            raise OutOfOrder(
                f"the update of step {self.current.step} has {self.count} of {self.sums} sums"
            )
