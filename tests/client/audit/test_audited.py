"""The carry plane audited by a wrapper (`client.audit.audited.Audited`, issue 66): the plane
keeps what each stage was sent and answered in its boundary cache, and the wrapper reads each
microbatch's work there after the microbatch; a replay from the cache is not audited, and a
microbatch is kept for its audit whatever the cache's budget. The plane is faked behind the
`Plane` seam, as it fills a real `BoundaryCache`; the replicas behind the `Reexecutor` seam."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from client.audit.audited import Audited
from client.audit.audits import Audits, Redone, Work, decoded
from client.data_plane.boundary_cache import Answer, BoundaryCache
from client.metrics import TrainerMetrics
from swarm.model.data import DataSource
from swarm.rpc.lease import MicrobatchResult, Replica, Task
from swarm.wire import codec
from swarm.wire.crossing import Crossing

X0, X1 = torch.arange(6.0).reshape(2, 3), torch.ones(2, 3)  # stage 0's inputs, stage 1's
TARGETS, G1 = torch.zeros(2, 3), torch.full((2, 3), 0.5)  # stage 1's input gradient: G1


class TwoStages:
    """A carry plane of two stages as the real one keeps its cache: stage 1 (the last) answered
    by `a`, stage 0 forward by `f` and backward by `b`; `answers` False: a replay from the cache,
    which answers nothing of its own."""

    def __init__(self, cache: BoundaryCache, answers: bool = True) -> None:
        self.cache, self.answers = cache, answers

    def follow(self, replicas: Sequence[Sequence[Replica]]) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def train(self, task: Task, data: DataSource) -> MicrobatchResult:
        step, index = task.step, task.index
        if self.answers:
            self.cache.remember(step, index, 1, Crossing(X1), TARGETS, ["f"])
            self.cache.answered(step, index, 1, Answer("a", "a", G1, loss_sum=2.5))
            self.cache.remember(step, index, 0, Crossing(X0), G1, ["a"])
            self.cache.answered(step, index, 0, Answer("f", "b", None))
        return MicrobatchResult(step, index, {0: "b", 1: "a"}, 2.5, 2, touched=("a", "b", "f"))

    async def evaluate(
        self, task: Task, ids: torch.Tensor, labels: torch.Tensor
    ) -> MicrobatchResult:
        raise AssertionError("not asked")


class Honest:
    """Two other replicas of each stage, re-executing to the answers they are shown."""

    def __init__(self) -> None:
        self.shown: list[Work] = []

    def peers(self, stage: int) -> list[str]:
        return [f"x{stage}", f"y{stage}"]

    async def redo(
        self, peer: str, step: int, index: int, work: Work, digest_seed: int = 0
    ) -> Redone:
        self.shown.append(work)
        outputs = decoded(work.outputs)  # as it came: encoded or not
        assert outputs is not None
        return Redone(outputs.clone(), decoded(work.grad_inputs))


class _NoData:
    """The fake plane reads no data."""

    def microbatch(self, step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise AssertionError("not read")


_DATA = _NoData()


def _audited(cache: BoundaryCache, plane: TwoStages, redo: Honest) -> Audited:
    audits = Audits(1.0, 1e-9, redo, TrainerMetrics("job"), rng=random.Random(0))
    return Audited(plane, cache, audits, stages=2)


async def test_each_stages_work_is_read_from_the_cache_after_the_microbatch() -> None:
    cache, redo = BoundaryCache(1 << 20, delays=False), Honest()
    audited = _audited(cache, TwoStages(cache), redo)
    result = await audited.train(Task(3, 1, frozenset({0, 1})), _DATA)
    assert result.stage_runs == 2 and result.audit_runs == 2 and result.verdicts == ()
    assert result.holders == {0: "b", 1: "a"} and result.touched == ("a", "b", "f")
    zero, one = sorted(redo.shown, key=lambda w: w.stage)
    # stage 0's outputs are what stage 1 was sent; the last stage's, its loss
    assert torch.equal(zero.outputs, X1) and zero.grad_inputs is None
    assert (zero.forward_peer, zero.backward_peer) == ("f", "b")
    assert zero.given.hidden is X0 and zero.grad_outputs is G1  # as the plane sent them
    assert float(one.outputs) == 2.5 and one.grad_inputs is G1
    assert (one.forward_peer, one.backward_peer) == ("a", "a")
    assert cache.answers(3, 1) == {}  # read once: a replay from the cache answers nothing


async def test_a_replay_from_the_cache_is_not_audited() -> None:
    cache, redo = BoundaryCache(1 << 20, delays=False), Honest()
    await _audited(cache, TwoStages(cache), redo).train(Task(3, 1, frozenset({0, 1})), _DATA)
    replayed = await _audited(cache, TwoStages(cache, answers=False), redo).train(
        Task(3, 1, frozenset({0})), _DATA
    )
    assert replayed.stage_runs == 0 and replayed.audit_runs == 0 and len(redo.shown) == 2


async def test_a_microbatch_is_kept_for_its_audit_whatever_the_budget() -> None:
    """A cache of no bytes forgets each microbatch at once (a replay re-runs it), yet the one
    in flight is held until its audit has read it."""
    cache, redo = BoundaryCache(0, delays=False), Honest()
    result = await _audited(cache, TwoStages(cache), redo).train(
        Task(3, 1, frozenset({0, 1})), _DATA
    )
    assert result.stage_runs == 2 and len(redo.shown) == 2
    assert len(cache) == 0 and cache.nbytes == 0  # let go after: trimmed to its budget


class Encoded(TwoStages):
    """`TwoStages`, what crossed kept as it went on the wire (encoded: a lossy codec's bytes)."""

    async def train(self, task: Task, data: DataSource) -> MicrobatchResult:
        step, index = task.step, task.index
        x1, g1 = codec.encode(X1, "inputs", codec.CODEC_BF16), codec.encode(G1, "grad_inputs")
        self.cache.remember(step, index, 1, Crossing(x1), TARGETS, ["f"])
        self.cache.answered(step, index, 1, Answer("a", "a", g1, loss_sum=2.5))
        self.cache.remember(step, index, 0, Crossing(X0), g1, ["a"])
        self.cache.answered(step, index, 0, Answer("f", "b", None))
        return MicrobatchResult(step, index, {0: "b", 1: "a"}, 2.5, 2, touched=("a", "b", "f"))


@pytest.mark.parametrize("fraction", [0.0, 1.0])
async def test_what_crossed_is_decoded_only_where_it_is_audited(
    fraction: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A review's find: every microbatch's boundary tensors were decoded on the trainer's event
    # loop before the draw (a lossy codec's decoding is compute), audited or not.
    decodes: list[str] = []
    decode = codec.decode

    def counted(t: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        decodes.append(t.name)
        return decode(t, *args, **kwargs)

    monkeypatch.setattr(codec, "decode", counted)
    cache, redo = BoundaryCache(1 << 20, delays=False), Honest()
    audits = Audits(fraction, 1e-2, redo, TrainerMetrics("job"), rng=random.Random(0))
    plane = Audited(Encoded(cache), cache, audits, stages=2)
    result = await plane.train(Task(3, 1, frozenset({0, 1})), _DATA)
    if fraction == 0.0:
        assert decodes == [] and result.audit_runs == 0  # nothing drawn: nothing decoded
    else:
        assert decodes and result.audit_runs == 2 and result.verdicts == ()
