"""A peer asked to measure a job too large for it (issue 44, N11) refuses it from the meta device,
before it builds a layer: an allocation the kernel cannot back kills the peer, it raises nothing.
And what a peer announces of its memory, the scheduler's bound at submit."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from stage_server.agent import PeerAgent
from stage_server.peer.fits import check_fits, device_memory, footprints
from stage_server.peer.limits import PeerLimits
from stage_server.replica.speed import measure_job
from swarm.bus.topics import Topics
from swarm.errors import ResourceExhausted
from swarm.proto import control_pb2 as cpb
from tests.support.devices import FakeFacts, Gpu
from tests.support.jobs import BASE, make_job, render

# d_model 8192 x 4096 blocks in 8 stages: 3.3 T parameters, 6 TiB of state a stage.
HUGE = {"d_model": 8192, "n_layers": 4096, "n_heads": 64}

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def nothing_built(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Building a stage fails the test: the refusal must come before any allocation. The cache
    of figures is the test's own."""

    def built(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a stage was built (allocated) for a job too large to hold")

    monkeypatch.setattr("stage_server.replica.speed.StageRuntime", built)
    monkeypatch.setenv("SWARM_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.attack("N11")
def test_a_stage_over_the_peers_memory_is_refused_before_anything_is_built(
    tmp_path: Path,
) -> None:
    job = make_job(tmp_path, "huge", model=HUGE, training={"stages": 8, "dtype": "float32"})
    with pytest.raises(ResourceExhausted) as e:
        measure_job(job, torch.device("cpu"))  # against this machine's own memory
    said = str(e.value)
    assert "stage 0 of job 'huge'" in said and "6.0 TiB of state" in said
    assert "nothing allocated" in said
    assert not (tmp_path / "cache" / "throughput.json").exists()  # no figure made up for it


def test_the_bound_is_the_peers_memory(tmp_path: Path) -> None:
    job = make_job(tmp_path)  # stages of some hundreds of KiB
    with pytest.raises(ResourceExhausted) as e:
        check_fits(job, torch.device("cpu"), memory_bytes=100 << 10)
    assert "100 KiB" in str(e.value)
    check_fits(job, torch.device("cpu"), memory_bytes=100 << 20)  # fits: no error


def test_a_device_says_its_memory() -> None:
    assert device_memory("cpu") > 1 << 28  # any machine that runs the tests
    if not torch.cuda.is_available():
        assert device_memory("cuda:0") == 0  # unknown: not said, bounds nothing


class _Bus:
    topics = Topics()

    def __init__(self) -> None:
        self.sent: list[Any] = []

    async def publish(self, topic: str, message: Any, retain: bool = False) -> None:
        self.sent.append(message)


async def _set(*args: Any) -> None:
    pass


@pytest.mark.attack("N11")
async def test_an_idle_peer_refuses_the_job_and_announces_its_memory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    executor, bus = ThreadPoolExecutor(1), _Bus()
    running: Any = SimpleNamespace(
        address="127.0.0.1:1",
        executor=executor,
        servicer=SimpleNamespace(release=lambda: None, trust=lambda job: None),
        health=SimpleNamespace(set=_set),
    )
    agent = PeerAgent(running, bus, peer="p", device="cpu")  # type: ignore[arg-type]
    try:
        spec = render({**BASE, "model": {**BASE["model"], **HUGE}}, name="huge")
        await agent._on_job(cpb.JobAnnouncement(job="j", spec=spec, state=cpb.JOB_STATE_PLACING))
        await agent.settled()  # its take-up (fetched, measured) done
        assert agent.job_id == "" and agent.speeds == {}, "refused: free for other jobs"
        assert "ResourceExhausted: stage 0 of job 'huge'" in caplog.text  # not a stage built
        said = bus.sent[-1]
        assert said.state == cpb.PEER_STATE_JOINING and said.memory_bytes == device_memory("cpu")
    finally:
        executor.shutdown()


# -- issue 41, deliverable 4: free device memory and the job's real footprint ------------------
def _job_on(tmp_path: Path) -> Any:
    return make_job(tmp_path, "small", training={"stages": 2, "dtype": "float32"})


def test_a_stage_that_fits_the_gpus_total_but_not_its_free_memory_is_refused(
    tmp_path: Path,
) -> None:
    """A GPU of 80 GiB with 1 MiB free (other processes hold the rest): the old check compared
    the stage's state with the total and built it, out of memory at the first allocation."""
    job = _job_on(tmp_path)
    each = footprints(job)
    largest = max(f.total for f in each)
    assert max(f.state for f in each) < 1 << 20 < largest, "state fits 1 MiB; activations do not"
    cuda = torch.device("cuda:0")
    check_fits(job, cuda, memory_bytes=80 << 30)  # what the total would allow
    busy = FakeFacts(gpus=[Gpu(free=1 << 20, total=80 << 30)])
    with pytest.raises(ResourceExhausted) as e:
        check_fits(job, cuda, facts=busy)
    said = str(e.value)
    assert "1.0 MiB free (torch.cuda.mem_get_info) of 80.0 GiB on cuda:0" in said, said
    assert "of activations at the cache's bound" in said and "nothing allocated" in said
    check_fits(job, cuda, facts=FakeFacts(gpus=[Gpu(free=largest, total=80 << 30)]))  # fits


def test_the_footprint_counts_activations_at_the_peers_bounds_and_the_chunks(
    tmp_path: Path,
) -> None:
    job = _job_on(tmp_path)
    roomy, tight = footprints(job), footprints(job, PeerLimits(max_activation_cache=1))
    first = roomy[0]
    assert tight[0].state == first.state and tight[0].activations < first.activations
    assert (
        tight[0].activations * 2
        == footprints(job, PeerLimits(max_activation_cache=3))[0].activations
    ), "one kept and one computed, against three kept and one computed"
    assert footprints(job, PeerLimits(max_activation_cache_bytes=1))[0].activations * 2 == (
        tight[0].activations
    ), "a bound below one microbatch keeps none"
    assert roomy[-1].activations < roomy[0].activations, "the last stage keeps none"
    assert first.averaging == 2 * job.runtime.chunk_bytes


def test_on_the_cpu_the_bound_is_the_hosts_available_memory(tmp_path: Path) -> None:
    job = _job_on(tmp_path)
    with pytest.raises(ResourceExhausted, match=r"1\.0 MiB available \(MemAvailable\)"):
        check_fits(job, torch.device("cpu"), facts=FakeFacts(host=1 << 20))
    check_fits(job, torch.device("cpu"), facts=FakeFacts(host=1 << 30))
