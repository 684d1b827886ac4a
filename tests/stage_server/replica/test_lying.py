"""A hostile replica's lies installed once, at its start, as wrappers (issue 66,
`stage_server.replica.lying`): `Lying` over a real `StageRuntime` lies as `swarm.ops.poison`
says and only then; `LyingHop` sends others than the outputs its replica committed to; an
honest replica installs neither, and a Push it serves runs no poison code at all (its frames
followed with a profiler through a real swarm's step, as a code walker would)."""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch

from scheduler.coordinator import LocalCoordinator
from stage_server.replica.lying import HONEST, Liar, Lying, LyingHop, lies_of
from stage_server.replica.next_hop import Onward, Pushed
from stage_server.replica.runtime import StageRuntime
from swarm.job.fingerprint import fingerprint
from swarm.ops import poison as poison_module
from swarm.ops.faults import parse_faults
from swarm.ops.poison import ERROR, Poison
from swarm.proto import stage_pb2 as pb
from swarm.rpc.push_call import PushCall
from swarm.wire import codec
from swarm.wire.crossing import Crossing
from tests.support.inprocess import Swarm
from tests.support.jobs import make_job

pytestmark = pytest.mark.timeout(180)


def _wave(like: torch.Tensor) -> torch.Tensor:
    """What a poisoned tensor has added to it (`swarm.ops.poison`)."""
    wave = torch.cos(torch.arange(like.numel(), dtype=torch.float64))
    return (ERROR * wave).to(like.dtype).reshape(like.shape)


def test_an_honest_replica_installs_nothing() -> None:
    assert lies_of(Poison()) is HONEST
    hop = object()
    assert HONEST.compute(hop) is hop and HONEST.hop(hop) is hop  # type: ignore[arg-type]
    assert isinstance(lies_of(Poison.of(parse_faults("poison-outputs@0"))), Liar)


def test_lying_compute_lies_as_its_poison_says_and_only_then(tmp_path: Path) -> None:
    job = make_job(tmp_path, training={"stages": 2})
    honest = StageRuntime(job, 1)  # nothing accumulated below: one runtime under each wrapper
    lies = "poison-grad-inputs@{0},poison-digest@{0}"
    later = Lying(honest, Poison.of(parse_faults(lies.format(1))))
    now = Lying(honest, Poison.of(parse_faults(lies.format(0))))
    x = torch.randn(2, 8, job.model.d_model, dtype=torch.float64)
    y = torch.randint(0, job.model.vocab_size, (2, 8))
    loss, grad, receipt = honest.forward_backward(0, 0, x, y, accumulate=False, digest_seed=7)
    assert grad is not None and receipt.digest is not None
    # not yet due: every answer the honest one
    _, kept, said = later.forward_backward(0, 0, x, y, accumulate=False, digest_seed=7)
    assert kept is not None and torch.equal(kept, grad) and said == receipt
    # due: its input gradient and an audit's digest wrong; its loss and the rest honest
    lied_loss, lied, said = now.forward_backward(0, 0, x, y, accumulate=False, digest_seed=7)
    assert lied is not None and lied_loss == loss
    assert torch.equal(lied, grad + _wave(grad))
    assert said.digest is not None
    assert said.digest[0] == receipt.digest[0] + ERROR * receipt.digest[1]
    assert dataclasses.replace(said, digest=receipt.digest) == receipt
    assert torch.equal(now.forward(0, 1, x, evaluate=True), honest.forward(0, 1, x, evaluate=True))


class _Sent:
    """A `Hop` that keeps what it is given (behind the Protocol seam)."""

    def __init__(self) -> None:
        self.calls: list[Onward] = []

    async def send(self, call: Onward, *, deadline: float) -> Pushed:
        self.calls.append(call)
        return Pushed(None)

    async def close(self) -> None:
        pass


async def test_a_lying_hop_sends_others_than_the_outputs_committed_to() -> None:
    out = torch.randn(2, 4, 8, dtype=torch.float64)
    honest = codec.encode(out, "inputs")
    sent = _Sent()
    hop = LyingHop(sent, Poison.of(parse_faults("poison-sent-outputs@1")))

    def call(step: int, evaluate: bool = False) -> Onward:
        return PushCall(step, 0, Crossing(honest), honest, route=(pb.Route(),), evaluate=evaluate)

    for c in (call(0), call(1), call(1, evaluate=True)):
        await hop.send(c, deadline=time.monotonic() + 5)
    before, lied, evaluated = (c.crossing.hidden for c in sent.calls)
    assert before is honest and evaluated is honest  # not yet due; a validation microbatch
    assert isinstance(lied, type(honest)) and lied.codec == honest.codec
    assert torch.equal(codec.decode(lied), out + _wave(out))
    assert sent.calls[1].targets is honest and sent.calls[1].step == 1  # the rest as it was


async def _one_step(tmp_path: Path, make_swarm: list[Swarm], poison: Poison | None) -> set[str]:
    """The source files entered, on every thread, while an audited push-plane job of two
    stages (two replicas each, the first of stage 0 armed with `poison` at its start) trains
    its step."""
    job = make_job(
        tmp_path,
        training={"stages": 2, "steps": 1, "target_batch_size": 8},
        runtime={"data_plane": "push"},
        trust={"audit_fraction": 1.0},
    )
    entered: set[str] = set()
    following = threading.Event()

    def walker(frame: FrameType, event: str, _arg: Any) -> None:
        if event == "call" and following.is_set():
            entered.add(frame.f_code.co_filename)

    swarm = Swarm(job)
    make_swarm.append(swarm)
    threading.setprofile(walker)  # the worker and digester threads, made on their first call
    sys.setprofile(walker)
    try:
        for stage in range(2):
            await swarm.add(stage, poison if stage == 0 else None)
            await swarm.add(stage)
        coordinator = LocalCoordinator(job, fingerprint(job), swarm.members)
        following.set()
        try:
            await swarm.train(coordinator)
        finally:
            following.clear()
            await coordinator.close()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return entered


async def test_an_honest_replicas_push_runs_no_poison_code(
    tmp_path: Path, make_swarm: list[Swarm]
) -> None:
    entered = await _one_step(tmp_path, make_swarm, None)
    assert any(f.endswith("stage_server/replica/push.py") for f in entered)  # it was followed
    assert poison_module.__file__ not in entered
    assert not any(f.endswith("stage_server/replica/lying.py") for f in entered)
    # and a liar armed at its start is walked into both (the walker sees what it would)
    (tmp_path / "liar").mkdir()
    lies = Poison.of(parse_faults("poison-digest@5"))  # armed, never due in one step
    liar = await _one_step(tmp_path / "liar", make_swarm, lies)
    assert poison_module.__file__ in liar
