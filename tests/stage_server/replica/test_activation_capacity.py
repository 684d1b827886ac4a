"""What a replica says its activation cache holds (`stage_server.replica.messages.Limits.capacity`,
its load reports' `activation_capacity`), on a real stage on the CPU: its bounds over the mean
footprint of the microbatches it kept, where its operator set the byte bound; nothing at the
CPU's default bound, at the last stage (it keeps nothing) or before its first microbatch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stage_server.peer.limits import PeerLimits
from stage_server.replica.messages import Limits
from stage_server.replica.runtime import StageRuntime
from swarm.device.claims import Claims
from swarm.device.sharing import CACHE_SHARE
from swarm.device.standin import StandInMemory
from swarm.wire.crossing import Crossing
from tests.support.jobs import make_job

pytestmark = pytest.mark.timeout(60)


def _served(tmp_path: Path, stage: int, limits: Limits) -> StageRuntime:
    job = make_job(tmp_path, training={"stages": 2}, runtime={"activation_cache": 6})
    rt = StageRuntime(job, stage)
    limits.serve(job)
    limits.bound(rt)
    return rt


def test_a_bound_set_by_the_operator_holds_what_fits_the_measured_footprint(
    tmp_path: Path,
) -> None:
    inputs = torch.randint(0, 64, (4, 16))
    probe = _served(tmp_path, 0, Limits(PeerLimits(max_activation_cache_bytes=1 << 30)))
    probe.forward(0, 0, Crossing(inputs))
    one = probe.cached_footprint
    assert one > 0
    limits = Limits(PeerLimits(max_activation_cache_bytes=3 * one + one // 2))
    rt = _served(tmp_path, 0, limits)
    assert limits.capacity(rt) == 0  # nothing measured yet: not said
    for index in range(4):
        rt.forward(0, index, Crossing(inputs))
    assert rt.cached_footprint == one
    assert limits.capacity(rt) == 3  # three fit the bytes, within the job's six
    roomy = Limits(PeerLimits(max_activation_cache_bytes=1 << 30))
    rt = _served(tmp_path, 0, roomy)
    rt.forward(0, 0, Crossing(inputs))
    assert roomy.capacity(rt) == 6  # the job's count bound


def test_the_cpu_default_and_the_last_stage_say_nothing(tmp_path: Path) -> None:
    default = Limits()
    rt = _served(tmp_path, 0, default)
    rt.forward(0, 0, Crossing(torch.randint(0, 64, (4, 16))))
    assert rt.cached_footprint > 0 and default.capacity(rt) == 0
    limits = Limits(PeerLimits(max_activation_cache_bytes=1 << 30))
    last = _served(tmp_path, 1, limits)
    assert last.is_last and limits.capacity(last) == 0


def test_replicas_on_one_device_say_their_part_of_it_and_keep_within_its_free_memory(
    tmp_path: Path,
) -> None:
    # Issue 63: each server sized its window alone, by the free memory read once. Two replicas
    # served on one (stand-in) device now say half of what one alone holds, and one keeps
    # within the device's free memory read again as each microbatch is kept.
    inputs = torch.randint(0, 64, (4, 16))
    claims = Claims(tmp_path / "claims")
    memory = StandInMemory(1 << 30, counts=False)  # its forwards counted by hooks, as a CPU's

    def on_the_device() -> tuple[Limits, StageRuntime]:
        limits = Limits(claims=claims)
        job = make_job(tmp_path, training={"stages": 2}, runtime={"activation_cache": 1024})
        rt = StageRuntime(job, 0)
        rt.memory = memory
        limits.serve(job)
        limits.bound(rt)
        return limits, rt

    alone, rt = on_the_device()
    rt.forward(0, 0, Crossing(inputs))
    one = rt.cached_footprint
    memory.used_elsewhere = memory.total - 40 * one  # room for 20 in one window (half of it)
    assert alone.capacity(rt) == 20
    other, rt2 = on_the_device()
    rt2.forward(0, 0, Crossing(inputs))
    assert alone.capacity(rt) == other.capacity(rt2) == 10
    for index in range(1, 6):
        rt.forward(0, index, Crossing(inputs))
    assert len(rt._cache) == 6 and rt.cache_evictions == 0
    memory.used_elsewhere = memory.total - 2 * one  # the device filled up meanwhile
    rt.forward(0, 6, Crossing(inputs))
    assert 0 < len(rt._cache) < 6 and list(rt._cache)[-1] == (0, 6, "")
    other.release()  # the other server stops serving: its part comes back
    assert alone.capacity(rt) > 0 and len(list((tmp_path / "claims").rglob("*.claim"))) == 1


def test_the_last_stage_claims_no_part_of_the_device_for_activations_it_never_keeps(
    tmp_path: Path,
) -> None:
    # The device check on an H200: 4 stage servers on one card, each window an even part of
    # the card's share, and 25 evictions in 6 steps at 4 microbatches of 8k tokens a step. The
    # last stage answers ForwardBackward in one call and keeps nothing between calls, yet its
    # claim took a quarter of the share from the three stages that keep a step's activations.
    claims = Claims(tmp_path / "claims")
    memory = StandInMemory(1 << 30, counts=False)
    job = make_job(tmp_path, training={"stages": 4}, runtime={"activation_cache": 1024})
    served = []
    for stage in range(4):
        limits = Limits(claims=claims)
        rt = StageRuntime(job, stage)
        rt.memory = memory
        limits.serve(job)
        limits.bound(rt)
        served.append(rt)
    share = int(memory.total * CACHE_SHARE)
    keeping = [rt.window.bytes for rt in served[:3]]
    assert keeping == [share // 3] * 3, [b / share for b in keeping]
    assert len(list((tmp_path / "claims").rglob("*.claim"))) == 3
    last = served[3]
    assert last.is_last and last.window.bytes <= PeerLimits().max_activation_cache_bytes
