"""A snapshot shares the replica's tensors and stays of its step: an update, a round's outer step
or a state loaded before its tensors are sent copies what is left (the tensor being sent
included), and one sent before any of them copies nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from stage_server.replica.messages import state_reply
from stage_server.replica.runtime import StageRuntime
from swarm.model.data import make_data
from tests.support.crossing import first_stage
from tests.support.downloads import decoded_state
from tests.support.jobs import make_job

CHUNK = 1024  # bytes: every parameter of the tiny model is several chunks


def _trained(tmp_path: Path, steps: int = 1, **pool: Any) -> StageRuntime:
    """A one-stage replica after `steps` commits (AdamW's moments exist)."""
    tmp_path.mkdir(exist_ok=True)
    job = make_job(tmp_path, training={"stages": 1}, **({"pool": pool} if pool else {}))
    rt, data = StageRuntime(job, 0), make_data(job)
    for step in range(steps):
        rt.forward_backward(step, 0, *first_stage(data.microbatch(step, 0)))
        assert rt.commit(step, [0], 4) is False
    return rt


def _step(rt: StageRuntime) -> None:
    """One more commit: changes every parameter and moment in place."""
    data = make_data(rt.job)
    rt.forward_backward(rt.step, 0, *first_stage(data.microbatch(rt.step, 0)))
    assert rt.commit(rt.step, [0], 4) is False


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


async def test_a_snapshot_sent_before_the_next_update_copies_nothing(tmp_path: Path) -> None:
    rt = _trained(tmp_path)
    want = rt.export_state()
    snapshot = rt.snapshot()
    params = dict(rt.module.named_parameters())
    shared = snapshot._state["param/" + next(iter(params))]
    assert shared.data_ptr() == next(iter(params.values())).data_ptr()  # not a copy
    _assert_equal(await decoded_state(state_reply(snapshot, CHUNK)), want)
    _step(rt)
    assert snapshot.copied_bytes == 0 and not snapshot._state  # sent, let go of


@pytest.mark.parametrize("sent", [0, 1, 7])
async def test_an_update_during_a_download_leaves_the_snapshot_of_its_step(
    tmp_path: Path, sent: int
) -> None:
    """`sent` messages went out when the update came: the rest (the tensor being sent, from its
    next chunk on) must still be the snapshot's step."""
    rt = _trained(tmp_path)
    want = rt.export_state()
    snapshot = rt.snapshot()
    reply = state_reply(snapshot, CHUNK)
    first = [next(reply) for _ in range(sent)]
    _step(rt)  # the worker applies the next commit meanwhile
    assert snapshot.copied_bytes > 0
    name = "param/" + next(iter(rt.state_dict()))
    assert not torch.equal(rt.export_state()[name], want[name])  # the replica did move
    _assert_equal(await decoded_state([*first, *reply]), want)


async def test_a_state_loaded_or_a_rounds_outer_step_during_a_download_is_not_seen(
    tmp_path: Path,
) -> None:
    rt = _trained(tmp_path)
    want = rt.export_state()
    other = _trained(tmp_path / "other", steps=2)
    snapshot = rt.snapshot()
    reply = state_reply(snapshot, CHUNK)
    first = next(reply)
    rt.load_state(other.step, other.export_state())  # a rollback meanwhile
    _assert_equal(await decoded_state([first, *reply]), want)

    local = _trained(tmp_path / "local", steps=2, mode="local", sync_every=2)
    want = local.export_state()
    reply = state_reply(local.snapshot(), CHUNK)
    first = next(reply)
    sums = local.round.prepare(2)
    local.round.set_prepared(2, sums, 8)
    assert local.round.apply(2) is False  # the outer step moves every parameter
    _assert_equal(await decoded_state([first, *reply]), want)
