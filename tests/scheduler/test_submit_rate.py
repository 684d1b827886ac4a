"""How fast one submitter may submit (issue 44, N11): `--max-jobs-per-submitter` counts unfinished
jobs only, so a loop of submit and cancel grew the scheduler without bound (each submit a
meta-device build, a stored spec, a retained announcement). `--max-submits-per-minute` bounds it per
submitter; another submitter still submits."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from client.sdk import ClientError, SchedulerClient
from scheduler.admission import Admission
from scheduler.callers import Callers
from scheduler.cli import add_arguments
from scheduler.submit_rate import SubmitRate
from swarm.errors import ConfigError, ResourceExhausted
from swarm.net.submitters import submitter_token
from tests.support.api import start_api
from tests.support.jobs import write_job

TOKEN = "swarm-token"
ADMIN_TOKEN = "admin-token-of-the-scheduler"

pytestmark = pytest.mark.timeout(120)


@pytest.mark.attack("N11")
async def test_a_submit_and_cancel_loop_is_refused_past_the_rate(tmp_path: Path) -> None:
    """Alice submits and cancels in a loop: refused with RESOURCE_EXHAUSTED naming the flag and
    when to retry, once past the burst (the default: 30 a minute, as many at once); Bob still
    submits."""
    api = await start_api(tmp_path, token=TOKEN, callers=Callers(ADMIN_TOKEN, mutual=False))
    alice_token = submitter_token(ADMIN_TOKEN, "alice")
    bob_token = submitter_token(ADMIN_TOKEN, "bob")
    try:
        async with (
            SchedulerClient(api.address, token=TOKEN, submitter_token=alice_token) as alice,
            SchedulerClient(api.address, token=TOKEN, submitter_token=bob_token) as bob,
        ):
            refused: ClientError | None = None
            accepted = 0
            for i in range(120):  # unbounded before: every one went through
                try:
                    job = (await alice.submit(write_job(tmp_path, f"loop{i}"))).job
                except ClientError as exc:
                    refused = exc
                    break
                accepted += 1
                await alice.cancel(job)
            assert refused is not None, f"{accepted} submits and cancels, none refused"
            assert refused.code == "RESOURCE_EXHAUSTED", refused
            assert "--max-submits-per-minute 30" in str(refused), refused
            assert "retry in" in str(refused), refused
            assert accepted >= 30  # the burst went through
            assert (await bob.submit(write_job(tmp_path, "bobs"))).job
    finally:
        await api.stop()


def test_the_bucket_refills_at_the_rate() -> None:
    now = [100.0]
    rate = SubmitRate(per_minute=6, burst=2, clock=lambda: now[0])  # one per 10 s
    rate.take("alice")
    rate.take("alice")
    with pytest.raises(ResourceExhausted) as e:
        rate.take("alice")
    assert "retry in 10 s" in str(e.value)
    rate.take("bob")  # each submitter its own
    now[0] += 5.0
    with pytest.raises(ResourceExhausted) as e:
        rate.take("alice")
    assert "retry in 5 s" in str(e.value)
    now[0] += 5.0
    rate.take("alice")  # one came back
    now[0] += 3600.0
    rate.take("alice")
    rate.take("alice")  # no more than the burst is saved up
    with pytest.raises(ResourceExhausted):
        rate.take("alice")


def test_bad_rates_are_refused() -> None:
    with pytest.raises(ConfigError, match="--max-submits-per-minute"):
        Admission(max_submits_per_minute=0)
    assert Admission(max_submits_per_minute=None).rate is None  # no bound


def test_the_burst_is_a_minutes_worth_or_the_queue() -> None:
    """Refused at its cap, a submitter cancels one and submits again: not refused for the rate
    (tests/scheduler/test_job_sizes.py's cap test does it with a cap of 3)."""
    default = Admission().rate
    assert default is not None and default.burst == 30
    big_queue = Admission(max_jobs_per_submitter=50, max_submits_per_minute=6).rate
    assert big_queue is not None and big_queue.burst == 50


def test_the_flag() -> None:
    parser = argparse.ArgumentParser()
    add_arguments("scheduler", parser)
    assert parser.parse_args([]).max_submits_per_minute == 30.0
    assert parser.parse_args(["--max-submits-per-minute", "5"]).max_submits_per_minute == 5.0
