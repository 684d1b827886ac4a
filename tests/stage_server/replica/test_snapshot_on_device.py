"""A snapshot of a state on a device (cuda) streams a chunk at a time: no host copy of the whole
state when it is taken (before: `share_state` copied a device's tensors to the host, 12 B a
parameter per download running), each chunk copied to the host only as it is sent, and still
the state of one step when an update comes mid-stream (issue 41, deliverable 5).

On the CPU a counting fake device (`tests.support.fake_device`) measures what crosses; on CUDA
(skipped without it) a real module and AdamW are served."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch

from stage_server.replica.snapshot import Snapshot
from swarm.model import stage_state
from swarm.proto import stage_pb2 as pb
from tests.support.downloads import decoded_state
from tests.support.fake_device import CountingCopies

CHUNK = 1024


def _reply(snapshot: Snapshot) -> Iterable[pb.StageDownloadStateResponse]:
    return snapshot.reply(lambda: pb.StageDownloadStateResponse(step=snapshot.step), CHUNK)


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {
        "param/w": torch.randn(40, 30, generator=gen),
        "param/b": torch.randn(30, generator=gen, dtype=torch.float64),
        "optim/0/step": torch.tensor(3.0),
    }


async def test_a_device_snapshot_crosses_to_the_host_a_chunk_at_a_time() -> None:
    state, copies = _state(), CountingCopies()
    want = {k: v.clone() for k, v in state.items()}
    snapshot = Snapshot(1, dict(state), shared=state.keys(), copies=copies)
    got = await decoded_state(_reply(snapshot))
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert copies.to_host_bytes == sum(t.nbytes for t in want.values())  # each byte once
    assert copies.largest <= CHUNK, copies.largest
    assert snapshot.copied_bytes == 0


@pytest.mark.parametrize("sent", [1, 3, 7])
async def test_an_update_mid_stream_leaves_a_device_snapshot_of_its_step(sent: int) -> None:
    """`sent` messages out, then the worker detaches the snapshot and changes the state in
    place: what follows is still the old step's, copied to the host once, at the detach."""
    state, copies = _state(), CountingCopies()
    want = {k: v.clone() for k, v in state.items()}
    snapshot = Snapshot(1, dict(state), shared=state.keys(), copies=copies)
    reply = iter(_reply(snapshot))
    first = [next(reply) for _ in range(sent)]
    snapshot.detach()
    for t in state.values():
        t.add_(1.0)  # the next update, in place
    got = await decoded_state([*first, *reply])
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert snapshot.copied_bytes > 0


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
@pytest.mark.parametrize("sent", [0, 5])
async def test_on_cuda_a_snapshot_shares_the_device_state_and_streams_one_step(sent: int) -> None:
    torch.manual_seed(0)
    module = torch.nn.Linear(256, 256).to("cuda:0")
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)

    def update() -> None:
        module(torch.randn(8, 256, device="cuda:0")).square().sum().backward()
        optimizer.step()

    update()
    want = {k: v.cpu() for k, v in stage_state.export_state(module, optimizer).items()}
    state, shared = stage_state.share_state(module, optimizer)
    assert state["param/weight"].data_ptr() == module.weight.data_ptr()  # no copy taken
    assert "param/weight" in shared and state["param/weight"].device.type == "cuda"
    snapshot = Snapshot(1, state, shared)
    reply = iter(_reply(snapshot))
    first = [next(reply) for _ in range(sent)]
    snapshot.detach()
    update()  # launched after the detach: not seen
    got = await decoded_state([*first, *reply])
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name
