"""The carry plane's boundary cache: per microbatch and stage, the bytes the trainer sent there
(the stage's inputs, and its output gradient or the targets; under a subspace boundary the
microbatch's token ids too). A gradient lost at one stage (its
replica died before the commit) is replayed from these with one call, on any replica: it
recomputes from the same bytes, so the gradient is the same. Bounded by `limit_bytes`, the
oldest microbatch forgotten first; a replay that finds nothing re-runs the pipeline instead.
Each entry keeps who produced its bytes (the replicas that answered the stage before's outputs
and the stage after's input gradient): a replay from them rests on those replicas' answers, and
one banned since (issue 55, `scheduler.coordinator.bans`) makes them worthless. So does a
rollback since (`swarm.rpc.epoch`): bytes of the same `(step, index)` taken before it may rest on
the banned peer's answers further up the pipeline than the producers kept name."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from swarm.proto import tensor_pb2
from swarm.rpc import epoch
from swarm.rpc.stage_client import TensorLike

__all__ = ["BoundaryCache"]

Key = tuple[int, int]  # (step, index)


class BoundaryCache:
    def __init__(self, limit_bytes: int, *, delays: bool) -> None:
        # delays: the job's rule computes a step on the parameters one update old (`Rule.delays`)
        self.limit_bytes, self.delays = limit_bytes, delays
        self._entries: OrderedDict[Key, dict[int, tuple[TensorLike, TensorLike]]] = OrderedDict()
        self._producers: dict[Key, dict[int, frozenset[str]]] = {}  # of each entry's bytes
        self._tokens: dict[Key, TensorLike] = {}  # `model.boundary_rank`: each stage needs them
        self._epochs: dict[Key, int] = {}  # the rollback epoch each entry's work was leased in
        self.nbytes = 0

    def remember(
        self,
        step: int,
        index: int,
        stage: int,
        inputs: TensorLike,
        grad: TensorLike,
        producers: Iterable[str] = (),
        tokens: TensorLike | None = None,
    ) -> None:
        # An old step's are useless (with delayed_update the step before is still live: a failed
        # round of its commit replays from them).
        live = step - 1 if self.delays else step
        for old in [key for key in self._entries if key[0] < live]:
            self._forget(old)
        if self._epochs.get((step, index), epoch.current()) != epoch.current():
            self._forget((step, index))  # a rollback since: the bytes before it are not the run's
        self._epochs[step, index] = epoch.current()
        self._entries.setdefault((step, index), {})[stage] = (inputs, grad)
        self._producers.setdefault((step, index), {})[stage] = frozenset(producers)
        self.nbytes += _nbytes(inputs) + _nbytes(grad)
        if tokens is not None and (step, index) not in self._tokens:
            self._tokens[step, index] = tokens
            self.nbytes += _nbytes(tokens)
        while self.nbytes > self.limit_bytes and self._entries:
            self._forget(next(iter(self._entries)))  # the oldest first

    def get(self, step: int, index: int) -> dict[int, tuple[TensorLike, TensorLike]] | None:
        """Stage -> (inputs, output gradient or targets) of microbatch `(step, index)`, as a run
        leased in the current task's rollback epoch sent them (none from before a rollback)."""
        if self._epochs.get((step, index)) != epoch.current():
            return None
        return self._entries.get((step, index))

    def producers(self, step: int, index: int, stages: Iterable[int]) -> set[str]:
        """The replicas whose answers the cached bytes of `stages` are."""
        held = self._producers.get((step, index), {})
        return {peer for k in stages for peer in held.get(k, ())}

    def tokens(self, step: int, index: int) -> TensorLike | None:
        """The token ids of microbatch `(step, index)` (a subspace boundary's), if remembered."""
        return self._tokens.get((step, index))

    def __len__(self) -> int:
        return len(self._entries)

    def _forget(self, key: Key) -> None:
        self._producers.pop(key, None)
        self._epochs.pop(key, None)
        for inputs, grad in self._entries.pop(key, {}).values():
            self.nbytes -= _nbytes(inputs) + _nbytes(grad)
        tokens = self._tokens.pop(key, None)
        if tokens is not None:
            self.nbytes -= _nbytes(tokens)


def _nbytes(value: TensorLike) -> int:
    if isinstance(value, tensor_pb2.Tensor):
        return len(value.data)
    return value.numel() * value.element_size()
