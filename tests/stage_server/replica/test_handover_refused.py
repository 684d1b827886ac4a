"""SWARM_FAULTS=handover-refuse@0 (issue 63): a stage server that refuses every tensor handed
over to it, through the real shared-memory handover, as b8f54b2's CUDA handover refused torch
2.11's handles; what bench/gpu_ratio.py --server-faults gives its servers to show a stall's
cause. Disarmed, the same handle is taken."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from stage_server.peer.metrics import StageMetrics
from stage_server.replica.handing import Handing
from swarm.device.shm_handover import SharedMemoryHandover
from swarm.errors import HandoverRefused
from swarm.ops import faults
from swarm.proto import tensor_pb2


@pytest.fixture(autouse=True)
def disarmed() -> Iterator[None]:
    yield
    faults.arm("")


def test_an_armed_server_refuses_every_handover_and_a_disarmed_one_takes_it(
    tmp_path: Path,
) -> None:
    shm = SharedMemoryHandover(tmp_path)
    handing = Handing(StageMetrics("p"), make=lambda _d: shm, site_of=lambda _d: "site")
    handing.serve(torch.device("cpu"))
    payload = torch.arange(16, dtype=torch.uint8)
    offer = shm.offer(payload)
    meta = tensor_pb2.Tensor(name="inputs", nbytes=16, handover=offer.handle)
    try:
        assert faults.arm("handover-refuse@0")[0].point == faults.Point.HANDOVER_REFUSE
        assert faults.refuses_handover()
        with pytest.raises(HandoverRefused, match="tensor 'inputs': injected fault"):
            handing.take(0, meta)
        faults.arm("")
        assert not faults.refuses_handover()
        assert torch.equal(handing.take(0, meta), payload)
    finally:
        offer.release()
