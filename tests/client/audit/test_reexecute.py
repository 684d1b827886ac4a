"""The carry plane's re-executor (`client.audit.reexecute`) asked to re-execute on a replica
its routes no longer follow: another trainer's audit banned it while this one's was between its
first and second auditor (two trainers, one liar, `tests/test_audits.py` found it). It must answer
as for any peer gone, which the audit counts as no evidence either way, not raise KeyError out of
the trainer's microbatch."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
import torch

from client.audit.audits import Work
from client.audit.reexecute import StageReexecutor
from swarm.clock import MonotonicClock
from swarm.errors import PeerUnavailable
from swarm.policy.wiring import Wiring
from swarm.proto import stage_pb2 as pb
from swarm.rpc.lease import Replica
from swarm.rpc.routes import Routes
from swarm.rpc.stage_client import BackwardResult
from swarm.wire import codec
from swarm.wire.crossing import Crossing
from tests.support.jobs import make_job


async def test_a_replica_no_longer_followed_is_gone_not_a_key_error(tmp_path: Path) -> None:
    job = make_job(tmp_path)
    wiring = Wiring(job.training.stages, clock=MonotonicClock(), rng=random.Random(0))
    reexecutor = StageReexecutor(job, Routes(job, "job", None, wiring))
    x = torch.zeros(2, 3)
    work = Work(1, Crossing(x), x, x, x, "a", "a")
    with pytest.raises(PeerUnavailable, match="banned-peer"):
        await reexecutor.redo("banned-peer", 5, 1, work)


class _Answering:
    """A replica's client whose answers are encoded as the wire carries them."""

    def __init__(self, address: str, stage: int) -> None:
        self.address, self.stage = address, stage

    async def forward(self, step: int, index: int, given: object, **_: object) -> object:
        return codec.encode(torch.ones(2, 3), "outputs", codec.CODEC_HADAMARD3)

    async def backward(self, *_: object, **__: object) -> BackwardResult:
        grads = codec.encode(torch.ones(2, 3), "grad_inputs", codec.CODEC_HADAMARD3)
        return BackwardResult(grads, pb.Receipt())


async def test_an_auditors_answer_is_widened_off_the_trainers_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An auditor's answer (a microbatch's crossing: millions of values of a real model) was
    decoded on the trainer's event loop, the loop its every step runs on."""
    job = make_job(tmp_path, training={"stages": 3})
    wiring = Wiring(job.training.stages, clock=MonotonicClock(), rng=random.Random(0))
    routes = Routes(
        job, "job", None, wiring, client_factory=lambda a, j, i, s, t, **_: _Answering(a, s)
    )
    routes.follow(1, [Replica("b", "b")])
    loop, threads = threading.current_thread(), []
    real = codec.decode

    def spy(msg: object, *a: object, **kw: object) -> torch.Tensor:
        threads.append(threading.current_thread())
        return real(msg, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(codec, "decode", spy)
    x = torch.zeros(2, 3)
    redone = await StageReexecutor(job, routes).redo(
        "b", 5, 1, Work(1, Crossing(x), x, x, x, "a", "a")
    )
    assert redone.outputs is not None and redone.outputs.shape == (2, 3)
    assert len(threads) == 2 and loop not in threads, threads
