"""What a submitted job must fit (issue 44, N11), on the job API over real gRPC and a real store:
a model no present peer could hold a stage of is refused at submit, naming its sizes; one
submitter's unfinished jobs are capped."""

from __future__ import annotations

from pathlib import Path

import pytest

from client.sdk import ClientError, SchedulerClient
from scheduler.admission import Admission
from scheduler.registry import PeerRegistry
from swarm.clock import FakeClock
from swarm.errors import ResourceExhausted
from swarm.job.config import load_job
from swarm.model.sizes import stage_state_bytes
from swarm.proto import control_pb2 as cpb
from tests.support.api import start_api
from tests.support.jobs import write_job

GiB = 1 << 30
# d_model 8192 x 4096 blocks: 3.3 T parameters, each of its 8 stages 412 G (6 TiB of state).
HUGE = {"d_model": 8192, "n_layers": 4096, "n_heads": 64}

pytestmark = pytest.mark.timeout(60)


def _peers(memory: int) -> PeerRegistry:
    """A registry that heard one idle peer, `gpu1`, announce `memory` bytes."""
    registry = PeerRegistry(FakeClock(), load_silence_s=10.0, serve_timeout_s=300.0)
    registry.announce(
        cpb.PeerAnnouncement(
            peer="gpu1",
            address="127.0.0.1:7001",
            device="cuda:0",
            state=cpb.PEER_STATE_JOINING,
            memory_bytes=memory,
        )
    )
    registry.announce(  # a peer that says nothing lowers nothing
        cpb.PeerAnnouncement(peer="old", address="127.0.0.1:7002", state=cpb.PEER_STATE_JOINING)
    )
    return registry


@pytest.mark.attack("N11")
async def test_a_model_no_present_peer_can_hold_is_refused_at_submit(tmp_path: Path) -> None:
    registry = _peers(80 * GiB)
    api = await start_api(tmp_path, admission=Admission(peer_memory=registry.largest_memory))
    try:
        async with SchedulerClient(api.address, timeout_s=30.0) as client:
            huge = write_job(tmp_path, "huge", model=HUGE, training={"stages": 8})
            with pytest.raises(ClientError) as e:
                await client.submit(huge)
            assert e.value.code == "RESOURCE_EXHAUSTED"
            said = str(e.value)
            # Its sizes and the bound, named: the largest stage, its state, the peer's memory.
            assert "parameters" in said and "TiB of state" in said and "3,29" in said
            assert "80.0 GiB" in said and "gpu1" in said and "training.stages" in said
            assert api.store.list() == [] and api.control.submitted_ids == []
            # A job that fits is taken as before.
            assert (await client.submit(write_job(tmp_path, "small"))).job
    finally:
        await api.stop()


async def test_the_operators_bound_on_a_stage_refuses_what_peers_would_take(
    tmp_path: Path,
) -> None:
    """--max-stage-bytes bounds a stage even before any peer said its memory; the smaller of the
    two bounds holds."""
    admission = Admission(max_stage_bytes=1 << 20)  # 1 MiB: d_model 32 fits (397 KiB), 64 not
    api = await start_api(tmp_path, admission=admission)
    try:
        async with SchedulerClient(api.address, timeout_s=30.0) as client:
            with pytest.raises(ClientError) as e:
                await client.submit(write_job(tmp_path, "small", model={"d_model": 64}))
            assert e.value.code == "RESOURCE_EXHAUSTED" and "--max-stage-bytes" in str(e.value)
            assert (await client.submit(write_job(tmp_path, "smaller"))).job  # d_model 32 fits
    finally:
        await api.stop()


@pytest.mark.attack("N11")
async def test_a_submitters_unfinished_jobs_are_capped(tmp_path: Path) -> None:
    cap = 3
    api = await start_api(tmp_path, admission=Admission(max_jobs_per_submitter=cap))
    try:
        async with SchedulerClient(api.address, timeout_s=30.0) as client:
            jobs = [(await client.submit(write_job(tmp_path, f"q{i}"))).job for i in range(cap)]
            with pytest.raises(ClientError) as e:
                await client.submit(write_job(tmp_path, "one-more"))
            assert e.value.code == "RESOURCE_EXHAUSTED"
            assert "--max-jobs-per-submitter 3" in str(e.value) and "3 unfinished" in str(e.value)
            assert len(api.store.list()) == cap
            await client.cancel(jobs[0])  # a finished job counts no more
            assert (await client.submit(write_job(tmp_path, "again"))).job
    finally:
        await api.stop()


async def test_the_cap_is_each_submitters_own(tmp_path: Path) -> None:
    """One submitter at the cap does not keep another out."""
    api = await start_api(tmp_path, admission=Admission(max_jobs_per_submitter=1))
    try:
        first = api.store.create("other", "spec", "/", 3, submitter="alice")
        async with SchedulerClient(api.address, timeout_s=30.0) as client:
            assert (await client.submit(write_job(tmp_path, "mine"))).job
        assert api.store.unfinished_of("alice") == 1 and api.store.unfinished_of("") == 1
        assert first.submitter == "alice"
    finally:
        await api.stop()


def test_a_stage_whose_state_fits_but_not_with_a_microbatch_is_refused(tmp_path: Path) -> None:
    """Issue 41, deliverable 4: a peer computes at least one microbatch beside the state, so a
    peer whose memory holds the state alone cannot serve the stage (the check was of the state
    alone, and took it)."""
    job = load_job(write_job(tmp_path, "long", training={"microbatch_size": 16}))
    state = max(stage_state_bytes(job))
    admission = Admission(peer_memory=lambda: (state + (64 << 10), "gpu1"))
    with pytest.raises(ResourceExhausted) as e:
        admission.check_size(job)
    said = str(e.value)
    assert "of state at least" in said and "of one microbatch's activations" in said, said
    assert "the largest memory a present peer announced (gpu1)" in said
    Admission(max_stage_bytes=state).check_size(job)  # --max-stage-bytes bounds the state
