"""The carry plane's re-executor (`client.audit.reexecute`) asked to re-execute on a replica
its routes no longer follow: another trainer's audit banned it while this one's was between its
first and second auditor (two trainers, one liar, `tests/test_audits.py` found it). It must answer
as for any peer gone, which the audit counts as no evidence either way, not raise KeyError out of
the trainer's microbatch."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from client.audit.audits import Work
from client.audit.reexecute import StageReexecutor
from swarm.clock import MonotonicClock
from swarm.errors import PeerUnavailable
from swarm.policy.wiring import Wiring
from swarm.rpc.routes import Routes
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
