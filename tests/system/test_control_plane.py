"""The control plane with real processes: a scheduler, joining stage servers, the client CLI, over
the embedded broker and over Mosquitto."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from client.sdk import ClientError
from swarm.cli import main
from swarm.job.config import load_job
from swarm.local.procs import LocalSwarm, start_local_swarm, start_process
from tests.support.brokers import Mosquitto
from tests.support.cli import swarm, swarm_forked
from tests.support.equality import assert_equal_to_local
from tests.support.jobs import write_job
from tests.support.status import job_status, job_status_message
from tests.support.waiting import wait_until_blocking

pytestmark = pytest.mark.slow


def _export(address: str, job_id: str, out: Path) -> None:
    """`swarm export JOB --out OUT`, forked (`swarm_forked`): an export imports torch, seconds of
    CPU a fresh interpreter spends first."""
    swarm_forked(
        "export",
        job_id,
        "--out",
        str(out),
        "--scheduler",
        address,
        log_dir=out.parent,
        name="export",
    )


@pytest.fixture
def mosquitto(tmp_path: Path) -> Iterator[Mosquitto]:
    broker = Mosquitto(tmp_path / "mosquitto")
    broker.start()
    yield broker
    broker.stop()


@pytest.mark.parametrize("broker", ["embedded", "mosquitto"])
def test_submit_wait_export_equals_local(
    tmp_path: Path, broker: str, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue("mosquitto").url if broker == "mosquitto" else None
    job = write_job(tmp_path, training={"steps": 6, "target_batch_size": 16})
    local_swarm, _ = start_local_swarm([1.0, 2.0, 1.0, 3.0, 1.0], log_dir=tmp_path, broker=url)
    try:
        submitted = swarm("submit", str(job), "--wait", "--scheduler", local_swarm.address)
        job_id = submitted.stdout.split()[0]
        assert "succeeded" in submitted.stdout
        _export(local_swarm.address, job_id, tmp_path / "swarm.pt")
        status = json.loads(
            swarm("status", job_id, "--json", "--scheduler", local_swarm.address).stdout
        )
        assert status["state"] == "JOB_STATE_SUCCEEDED" and int(status["step"]) == 6
        metrics = (
            urllib.request.urlopen(
                f"http://127.0.0.1:{local_swarm.scheduler.ready['metrics']}/metrics", timeout=10
            )
            .read()
            .decode()
        )
        assert "swarm_scheduler_peers" in metrics
        assert f'swarm_job_state{{job="{job_id}",state="succeeded"}} 1.0' in metrics
    finally:
        local_swarm.stop()
    assert_equal_to_local(job, torch.load(tmp_path / "swarm.pt"), tol=1e-9)
    assert all("Traceback" not in p.log() for p in [local_swarm.scheduler, *local_swarm.peers])


def _wait_step(sw: LocalSwarm, job_id: str, at_least: int, timeout: float = 120) -> int:
    # Asked in this process (`tests.support.status`), not by a `swarm status` process a look.
    def step() -> int | None:
        try:
            step = int(job_status_message(sw.address, job_id).step)
        except ClientError:  # not answered now (a scheduler restarting, say)
            return None
        return step if step >= at_least else None

    what = f"job {job_id} at step {at_least}"
    return wait_until_blocking(step, what, timeout_s=timeout, every_s=0.3)


def test_scheduler_killed_and_restarted_resumes_the_job(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    # Throttled peers make steps slow enough to kill the scheduler in the middle of the job: it
    # is killed at step 3 or a little later, 9 steps short of the end (a step's time grows with
    # the machine's load as the poll's does; 10x is still several seconds of margin idle).
    job = write_job(tmp_path, training={"steps": 12, "target_batch_size": 32})
    sw, args = start_local_swarm([10.0] * 4, log_dir=tmp_path, broker=mosquitto.url)
    try:
        out = swarm("submit", str(job), "--scheduler", sw.address).stdout
        job_id = out.split()[0]
        assert _wait_step(sw, job_id, 3) < 12
        sw.scheduler.kill()  # SIGKILL: no goodbye, the embedded trainer dies mid-step
        sw.restart_scheduler(args)
        assert job_id in swarm("jobs", "--scheduler", sw.address).stdout
        _wait_step(sw, job_id, 12, timeout=240)
        _export(sw.address, job_id, tmp_path / "swarm.pt")
        assert "resuming job" in sw.scheduler.log()
    finally:
        sw.stop()
    assert_equal_to_local(job, torch.load(tmp_path / "swarm.pt"), tol=1e-9)


def test_wrong_token_is_refused(tmp_path: Path) -> None:
    token_env = {"SWARM_TOKEN": "s3cret"}
    sw, _ = start_local_swarm([], log_dir=tmp_path, env=token_env)
    try:
        ok = swarm("jobs", "--scheduler", sw.address, env=token_env)
        assert ok.returncode == 0
        for env in ({"SWARM_TOKEN": "wrong"}, {"SWARM_TOKEN": ""}):
            refused = swarm("jobs", "--scheduler", sw.address, env=env, check=False)
            assert refused.returncode != 0
            assert "UNAUTHENTICATED" in refused.stderr or "token" in refused.stderr.lower()
        # a stage server with the wrong token cannot join through the broker
        peer = start_process(
            ["stage-server", "--broker", sw.broker, "--port", "0"],
            log_dir=tmp_path,
            name="intruder",
            env={"SWARM_TOKEN": "wrong"},
        )
        assert peer.proc.wait(60) != 0
        assert "refused" in peer.log().lower() or "not authori" in peer.log().lower()
        url = f"http://127.0.0.1:{sw.scheduler.ready['metrics']}/metrics"
        # with a token, /metrics wants it too (the metrics token defaults to the swarm's)
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(url, timeout=10)
        scrape = urllib.request.Request(url, headers={"Authorization": "Bearer s3cret"})
        metrics = urllib.request.urlopen(scrape, timeout=10).read().decode()
        refused_lines = [
            line for line in metrics.splitlines() if line.startswith("swarm_auth_refused_total")
        ]
        assert refused_lines and float(refused_lines[0].split()[-1]) >= 2
    finally:
        sw.stop()


def test_pools_and_a_remote_trainer_equal_local(tmp_path: Path) -> None:
    job = write_job(tmp_path, training={"steps": 8, "target_batch_size": 32})
    # No embedded trainer: the remote one trains every microbatch, however fast the steps go
    # (with both, a job done before the remote trainer's first lease left it nothing).
    sw, _ = start_local_swarm(
        [1.0, 1.0, 2.0, 2.0, 1.0, 3.0, 1.0, 2.0],
        log_dir=tmp_path,
        extra_scheduler=["--no-embedded-trainer"],
    )
    try:
        job_id = swarm("submit", str(job), "--scheduler", sw.address).stdout.split()[0]
        remote = start_process(
            ["trainer", "--scheduler", sw.address, "--job", job_id],
            log_dir=tmp_path,
            name="remote-trainer",
            env=sw.env,
        )
        _wait_step(sw, job_id, 8)
        assert remote.proc.wait(60) == 0, remote.log()[-2000:]
        _export(sw.address, job_id, tmp_path / "swarm.pt")
        # every peer became a replica: all stages covered, and pools of several replicas
        # (placement sizes them by measured speed, so the slowest stage gets the most)
        placed = Counter(re.findall(r"stage (\d) -> peer\d", sw.scheduler.log()))
        assert sum(placed.values()) == 8 and set(placed) == {"0", "1", "2", "3"}, placed
        assert max(placed.values()) >= 2, placed
        trained = re.search(r"trained (\d+) microbatches", remote.log())
        config = load_job(job).training
        every = 8 * config.target_batch_size // config.microbatch_size
        assert trained and int(trained.group(1)) == every, remote.log()[-2000:]
    finally:
        sw.stop()
    assert_equal_to_local(job, torch.load(tmp_path / "swarm.pt"), tol=1e-9)


def test_trainer_killed_and_broker_restarted_mid_job(tmp_path: Path, mosquitto: Mosquitto) -> None:
    """A remote trainer is SIGKILLed holding leases (they are re-issued), and the broker is
    restarted mid-job (every process reconnects and re-publishes its retained state)."""
    job = write_job(
        tmp_path, training={"steps": 12, "target_batch_size": 32}, runtime={"lease_timeout_s": 2.0}
    )
    # Throttled, as above: killed at step 2 or a little later, 10 steps short of the end.
    sw, _ = start_local_swarm([10.0] * 4, log_dir=tmp_path, broker=mosquitto.url)
    try:
        job_id = swarm("submit", str(job), "--scheduler", sw.address).stdout.split()[0]
        remote = start_process(
            ["trainer", "--scheduler", sw.address, "--job", job_id],
            log_dir=tmp_path,
            name="doomed-trainer",
            env=sw.env,
        )
        assert _wait_step(sw, job_id, 2) < 12
        remote.kill()  # SIGKILL: its leased microbatches are never reported
        mosquitto.stop()
        time.sleep(1.0)
        mosquitto.start()  # same port: the bus reconnects by itself
        _wait_step(sw, job_id, 12, timeout=240)
        _export(sw.address, job_id, tmp_path / "swarm.pt")
        # it connected twice: at start, and again by itself after the broker came back
        assert sw.scheduler.log().count("bus scheduler: connected to") >= 2
    finally:
        sw.stop()
    assert remote.proc.returncode == -9
    assert_equal_to_local(job, torch.load(tmp_path / "swarm.pt"), tol=1e-9)


def test_demo_trains_through_a_killed_replica_and_cleans_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 40 steps: the replica is killed between step 20 and step 37, whatever the machine's load.
    # `swarm demo`'s own `main`, in this process: the scheduler and stage servers it starts
    # are forked from the suite's fork server (`tests.support.forked`), not six fresh
    # interpreters each importing torch (about 6 s of CPU apiece, on 2 busy cores).
    corpus = Path(__file__).resolve().parents[2] / "examples" / "data" / "corpus.txt"
    job = write_job(
        tmp_path,
        model={"vocab_size": 256},
        data={"kind": "text", "path": str(corpus)},
        training={"steps": 40, "target_batch_size": 16},
    )
    code = main(["demo", "--job", str(job)])
    result = capsys.readouterr()
    assert code == 0, result.out[-2000:] + result.err[-3000:]
    told = [line for line in (result.out + result.err).splitlines() if "** " in line]
    assert any("killed peer" in line for line in told), told  # else the demo's why not
    assert "succeeded: 40 steps" in result.out
    # It ends with what the model learned: text sampled after the prompt, on one line.
    said = result.out.split("a sample of what it learned", 1)[1].splitlines()[1]
    assert said.startswith("  The Fox") and len(said) > len("  The Fox") + 40, said
    assert "all processes stopped" in result.out


def test_rebalancing_moves_a_peer_to_the_bottleneck_and_stays_exact(tmp_path: Path) -> None:
    # Every peer is 6x slower while it serves stage 1, which its join-time measurement cannot
    # see: placement spreads the peers evenly, and only live measurements reveal stage 1 as the
    # bottleneck. Rebalancing moves a peer there; the float64 result is still exact. Three
    # blocks, one per stage, with the embedding and the head beside the outer ones: stage 1 is
    # the cheapest, so placement leaves a spare replica on stage 0 or 2 to move (with two blocks
    # on stage 1, placement may give it four peers and the others one each: nothing to move).
    # 20 steps: the first move comes a period (1 s) after the first live measurements, a few
    # steps into the job (a step is slower on a busier machine, as the measurements are).
    job = write_job(
        tmp_path,
        model={"n_layers": 3},
        training={"stages": 3, "steps": 20, "target_batch_size": 32},
        rebalance={"period_s": 1.0, "hysteresis": 1.05, "min_dwell_s": 1000.0, "move_cost_s": 0.0},
    )
    sw, _ = start_local_swarm([1.0] * 6, log_dir=tmp_path, env={"SWARM_STAGE_THROTTLE": "1:6"})
    try:
        job_id = swarm("submit", str(job), "--scheduler", sw.address).stdout.split()[0]
        _wait_step(sw, job_id, 20, timeout=300)
        _export(sw.address, job_id, tmp_path / "swarm.pt")
        moves = re.findall(r"moving (peer\d) from stage (\d) to stage (\d)", sw.scheduler.log())
        metrics = (
            urllib.request.urlopen(
                f"http://127.0.0.1:{sw.scheduler.ready['metrics']}/metrics", timeout=10
            )
            .read()
            .decode()
        )
    finally:
        sw.stop()
    assert any(dst == "1" for _, _, dst in moves), moves  # a peer moved to the bottleneck
    assert f'swarm_scheduler_rebalancing_moves_total{{job="{job_id}"}}' in metrics
    assert_equal_to_local(job, torch.load(tmp_path / "swarm.pt"), tol=1e-9)


def test_a_hung_replica_is_left_out_when_its_load_reports_stop(tmp_path: Path) -> None:
    # SIGSTOP: the process hangs with its connections open, so neither a closed socket nor the
    # (embedded) broker's last-will says it is gone; its silence on the load topic does.
    # 24 steps: it is left out 2 s after it stops, long before the job ends (until then its
    # stage's microbatches to it time out, so the job hardly moves on). A pool round it was
    # already in waits `averaging_timeout_s` for it: 5 s, not the default minute. A PREPARE the
    # coordinator had sent it as it stopped ends when the registry leaves it out
    # (`scheduler.coordinator.listed`), not after `commit_timeout_s` (the default 2 minutes).
    job = write_job(
        tmp_path,
        training={"steps": 24, "target_batch_size": 16},
        runtime={"rpc_timeout_s": 3.0, "averaging_timeout_s": 5.0},
    )
    sw, _ = start_local_swarm(
        [3.0] * 5, log_dir=tmp_path, extra_scheduler=["--load-silence-s", "2"]
    )
    stopped = None
    try:
        job_id = swarm("submit", str(job), "--scheduler", sw.address).stdout.split()[0]
        _wait_step(sw, job_id, 3)
        status = job_status(sw.address, job_id)
        pooled = next(s for s in status["stages"] if len(s.get("replicas", [])) >= 2)
        victim = pooled["replicas"][0]["peer"]
        stopped = next(p for p in sw.peers if p.ready["peer"] == victim)
        os.kill(stopped.proc.pid, signal.SIGSTOP)
        _wait_step(sw, job_id, 24, timeout=240)
        _export(sw.address, job_id, tmp_path / "swarm.pt")
        assert f"{victim}'s load reports stopped" in sw.scheduler.log()
    finally:
        if stopped is not None:
            stopped.kill()  # SIGKILL works on a stopped process
        sw.stop()
    assert_equal_to_local(job, torch.load(tmp_path / "swarm.pt"), tol=1e-9)


def _wait_rollback(sw: LocalSwarm, job_id: str, timeout: float = 120) -> str:
    """What the job's status said of the rollback (its message, or its rollback event once the
    message is back to "training"), asked in this process as `_wait_step` asks."""
    said = [""]

    def rolled_back() -> str | None:
        status = job_status(sw.address, job_id)
        events = [e["text"] for e in status.get("events", []) if e["kind"] == "rollback"]
        said[0] = events[-1] if events else status.get("message", "")
        return said[0] if "rolled back" in said[0] else None

    return wait_until_blocking(
        rolled_back, lambda: f"a rollback said (last: {said[0]!r})", timeout_s=timeout, every_s=0.3
    )


def test_stage_lost_under_the_scheduler_rolls_back_and_says_so(tmp_path: Path) -> None:
    # One replica per stage; the one of stage 2 is SIGKILLed, a fresh peer joins and takes the
    # empty stage, every stage rolls back to the last checkpoint, `swarm status` says so, and
    # the job still ends with `swarm local`'s parameters. 20 steps: the kill comes after step 6
    # (the checkpoint of step 4 is sealed), the job is asserted short of step 16 then, and it
    # trains on from the rollback (to step 4, 8 or 12) to its end. Peers throttled 10x: 10 steps
    # between the first look (step 6) and the assertion, whatever the load.
    job = write_job(
        tmp_path, training={"steps": 20, "target_batch_size": 16, "checkpoint_every": 4}
    )
    sw, _ = start_local_swarm([10.0] * 4, log_dir=tmp_path)
    try:
        job_id = swarm("submit", str(job), "--scheduler", sw.address).stdout.split()[0]
        assert _wait_step(sw, job_id, 6) < 16
        status = job_status(sw.address, job_id)
        victim = status["stages"][2]["replicas"][0]["peer"]
        next(p for p in sw.peers if p.ready["peer"] == victim).kill()
        # The stall is said: which stage, since when, what to do, what will follow.
        deadline, now = time.monotonic() + 30, status
        while time.monotonic() < deadline and not now["message"].startswith("stalled"):
            time.sleep(0.2)
            now = job_status(sw.address, job_id)
        assert re.match(r"stalled at step \d+: stage 2 has no replica since ", now["message"]), now
        assert "start a stage server" in now["message"] and now["waiting_since"] > 0, now
        assert "rolls back to step" in now["message"], now
        # With stage 2 gone no step can commit: this is as far as the job got.
        stalled = int(now["step"])
        sw.add_peer(10.0)
        said = _wait_rollback(sw, job_id)
        rolled_to = re.search(r"rolled back to step (\d+)", said)
        assert rolled_to is not None, said
        # To a sealed checkpoint, not past where the job was when its stage died.
        assert int(rolled_to[1]) % 4 == 0 and 0 < int(rolled_to[1]) <= stalled, (said, stalled)
        _wait_step(sw, job_id, 20, timeout=240)
        _export(sw.address, job_id, tmp_path / "swarm.pt")
        metrics = (
            urllib.request.urlopen(
                f"http://127.0.0.1:{sw.scheduler.ready['metrics']}/metrics", timeout=10
            )
            .read()
            .decode()
        )
        assert f'swarm_coordinator_rollbacks_total{{job="{job_id}"}} 1.0' in metrics
        # `status` tells the story afterwards: the job's history, in order (plain `status` lists
        # its newest 10 events, `--json` 50).
        told = swarm("status", job_id, "--scheduler", sw.address).stdout
        assert "succeeded: 20 steps" in told.split("events:\n")[1], told
        doc = job_status(sw.address, job_id)
        history = "\n".join(e["text"] for e in doc["events"])
        order = [
            f"{victim} left stage 2: its connection dropped",
            "stage 2 lost its last replica",
            "joined stage 2",
            "rolled back to step",
            "succeeded: 20 steps",
        ]
        at = [0]
        for what in order:  # each after the one before
            at.append(history.find(what, at[-1]))
        assert -1 not in at, history
        # (the stall watch looks every second: the rollback may be said before or after it)
        assert "stage 2 is served again" in history, history
        assert re.search(  # and the scheduler's log, as a warning, with the remedy
            r"WARNING scheduler.history: job \S+: stage 2 lost its last replica at step \d+: "
            r"training stalled; start a stage server",
            sw.scheduler.log(),
        )
    finally:
        sw.stop()
    assert_equal_to_local(job, torch.load(tmp_path / "swarm.pt"), tol=1e-9)


def test_a_stage_lost_while_the_scheduler_was_down_rolls_back(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    # The scheduler and stage 2's only replica are SIGKILLed together. The restarted scheduler
    # finds no replica with stage 2's trained state; after the grace period a fresh peer takes
    # the stage, every stage rolls back to the last checkpoint, and the result is still exact.
    # 20 steps: the kill comes after step 6 and before step 16, as in the test above.
    job = write_job(
        tmp_path, training={"steps": 20, "target_batch_size": 16, "checkpoint_every": 4}
    )
    sw, args = start_local_swarm(
        [10.0] * 4,
        log_dir=tmp_path,
        broker=mosquitto.url,  # outlives the scheduler, as a real deployment's does
        extra_scheduler=["--lost-stage-grace-s", "2"],
    )
    try:
        job_id = swarm("submit", str(job), "--scheduler", sw.address).stdout.split()[0]
        assert _wait_step(sw, job_id, 6) < 16
        status = job_status(sw.address, job_id)
        victim = status["stages"][2]["replicas"][0]["peer"]
        sw.scheduler.kill()
        next(p for p in sw.peers if p.ready["peer"] == victim).kill()
        sw.restart_scheduler(args)
        sw.add_peer(10.0)
        said = _wait_rollback(sw, job_id)
        rolled_to = re.search(r"rolled back to step (\d+)", said)
        assert rolled_to is not None and int(rolled_to[1]) % 4 == 0, said
        _wait_step(sw, job_id, 20, timeout=240)
        _export(sw.address, job_id, tmp_path / "swarm.pt")
    finally:
        sw.stop()
    assert_equal_to_local(job, torch.load(tmp_path / "swarm.pt"), tol=1e-9)


def test_peers_freed_by_one_job_join_the_next(tmp_path: Path) -> None:
    # The second job is announced while every peer trains the first: once that one ends, the
    # freed peers join the second (the agent remembers it; the scheduler also re-announces it).
    job = write_job(tmp_path, training={"steps": 24, "target_batch_size": 16})
    sw, _ = start_local_swarm([5.0] * 4, log_dir=tmp_path)
    try:
        first = swarm("submit", str(job), "--scheduler", sw.address).stdout.split()[0]
        assert _wait_step(sw, first, 1) < 24
        second = swarm("submit", str(job), "--wait", "--scheduler", sw.address, timeout=240)
        assert "succeeded" in second.stdout
        status = job_status(sw.address, first)
        assert status["state"] == "JOB_STATE_SUCCEEDED"
    finally:
        sw.stop()
