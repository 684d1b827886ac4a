"""The carry plane's boundary cache: per microbatch and stage, the bytes the trainer sent there
(what crossed into the stage, `swarm.wire.crossing.Crossing`: its inputs and, under a subspace
boundary, the microbatch's token ids; and its output gradient or the targets). A gradient lost at
one stage (its replica died before the commit) is replayed from these with one call, on any
replica: it recomputes from the same bytes, so the gradient is the same. Bounded by
`limit_bytes`, the oldest microbatch forgotten first; a replay that finds nothing re-runs the
pipeline instead. Each entry keeps who produced its bytes (the replicas that answered the stage
before's outputs and the stage after's input gradient): a replay from them rests on those
replicas' answers, and one banned since (issue 55, `scheduler.coordinator.trust.bans`) makes them
worthless. So does a rollback since (`swarm.rpc.epoch`): bytes of the same `(step, index)` taken
before it may rest on the banned peer's answers further up the pipeline than the producers kept
name.

It keeps what each stage answered too (`Answer`: who, and the input gradient, or the loss), so
that a microbatch's work can be read whole after it ran: the trainer's audits
(`client.audit.audited.Audited`, a wrapper around the carry plane) read it there instead of the
plane building it in its backward loop. A microbatch `held` is not forgotten for the budget
until it is let go, so its audit always finds it."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from swarm.proto import tensor_pb2
from swarm.rpc import epoch
from swarm.rpc.stage_client import TensorLike, WireCrossing

__all__ = ["Answer", "BoundaryCache"]

Key = tuple[int, int]  # (step, index)


@dataclass(frozen=True)
class Answer:
    """What one stage of a microbatch answered the trainer: who, and what came back besides its
    outputs (which are the next stage's inputs, kept there)."""

    forward_peer: str  # who answered the outputs
    backward_peer: str  # who answered the input gradient (and accumulated the stage's gradient)
    grad_inputs: TensorLike | None  # None where none was asked for (the run's lowest stage)
    loss_sum: float | None = None  # the last stage's loss, its outputs


class BoundaryCache:
    def __init__(self, limit_bytes: int, *, delays: bool) -> None:
        # delays: the job's rule computes a step on the parameters one update old (`Rule.delays`)
        self.limit_bytes, self.delays = limit_bytes, delays
        self._entries: OrderedDict[Key, dict[int, tuple[WireCrossing, TensorLike]]] = OrderedDict()
        self._producers: dict[Key, dict[int, frozenset[str]]] = {}  # of each entry's bytes
        # `model.boundary_rank`: the token ids every stage's crossing shares, counted once
        self._tokens: dict[Key, TensorLike] = {}
        self._epochs: dict[Key, int] = {}  # the rollback epoch each entry's work was leased in
        self._answers: dict[Key, dict[int, Answer]] = {}  # what each stage answered
        self._held: set[Key] = set()  # not forgotten for the budget while held
        self.nbytes = 0

    def remember(
        self,
        step: int,
        index: int,
        stage: int,
        crossing: WireCrossing,
        grad: TensorLike,
        producers: Iterable[str] = (),
    ) -> None:
        """What crossed into `stage` of microbatch `(step, index)` and its output gradient (or
        the targets), as the replicas `producers` answered them."""
        # An old step's are useless (with delayed_update the step before is still live: a failed
        # round of its commit replays from them).
        live = step - 1 if self.delays else step
        for old in [key for key in self._entries if key[0] < live and key not in self._held]:
            self._forget(old)
        if self._epochs.get((step, index), epoch.current()) != epoch.current():
            self._forget((step, index))  # a rollback since: the bytes before it are not the run's
        self._epochs[step, index] = epoch.current()
        stages = self._entries.setdefault((step, index), {})
        if stage in stages:  # the stage run again (a retry): its new bytes replace the old
            self.nbytes -= _entry_nbytes(*stages[stage])
        stages[stage] = (crossing, grad)
        self._producers.setdefault((step, index), {})[stage] = frozenset(producers)
        self.nbytes += _entry_nbytes(crossing, grad)
        if crossing.tokens is not None and (step, index) not in self._tokens:
            self._tokens[step, index] = crossing.tokens
            self.nbytes += _nbytes(crossing.tokens)
        self._trim()

    def answered(self, step: int, index: int, stage: int, answer: Answer) -> None:
        """Stage `stage` of microbatch `(step, index)` answered `answer` (kept while its entry
        is: its tensors are the entry's own, or a float)."""
        if (step, index) in self._entries:
            self._answers.setdefault((step, index), {})[stage] = answer

    def answers(self, step: int, index: int) -> dict[int, Answer]:
        """Stage -> what it answered, of microbatch `(step, index)` as it was run in the current
        rollback epoch (none from before a rollback)."""
        if self._epochs.get((step, index)) != epoch.current():
            return {}
        return dict(self._answers.get((step, index), {}))

    @contextmanager
    def held(self, step: int, index: int) -> Iterator[None]:
        """Microbatch `(step, index)` kept whatever the budget while inside; what it answered is
        forgotten after (a later replay from the cache answers nothing of its own)."""
        self._held.add((step, index))
        try:
            yield
        finally:
            self._held.discard((step, index))
            self._answers.pop((step, index), None)
            self._trim()

    def get(self, step: int, index: int) -> dict[int, tuple[WireCrossing, TensorLike]] | None:
        """Stage -> (what crossed in, output gradient or targets) of microbatch `(step, index)`,
        as a run leased in the current task's rollback epoch sent them (none from before a
        rollback)."""
        if self._epochs.get((step, index)) != epoch.current():
            return None
        return self._entries.get((step, index))

    def producers(self, step: int, index: int, stages: Iterable[int]) -> set[str]:
        """The replicas whose answers the cached bytes of `stages` are."""
        held = self._producers.get((step, index), {})
        return {peer for k in stages for peer in held.get(k, ())}

    def __len__(self) -> int:
        return len(self._entries)

    def _trim(self) -> None:
        """Forget the oldest microbatches not held until the cache is within its budget."""
        while self.nbytes > self.limit_bytes:
            oldest = next((key for key in self._entries if key not in self._held), None)
            if oldest is None:
                return  # only held ones left: trimmed once they are let go
            self._forget(oldest)

    def _forget(self, key: Key) -> None:
        self._producers.pop(key, None)
        self._answers.pop(key, None)
        self._epochs.pop(key, None)
        for crossing, grad in self._entries.pop(key, {}).values():
            self.nbytes -= _entry_nbytes(crossing, grad)
        tokens = self._tokens.pop(key, None)
        if tokens is not None:
            self.nbytes -= _nbytes(tokens)


def _entry_nbytes(crossing: WireCrossing, grad: TensorLike) -> int:
    """A stage's entry: what crossed in (its token ids apart: counted once a microbatch) and
    its output gradient."""
    return _nbytes(crossing.hidden) + _nbytes(grad)


def _nbytes(value: TensorLike) -> int:
    if isinstance(value, tensor_pb2.Tensor):
        return len(value.data)
    return value.numel() * value.element_size()
