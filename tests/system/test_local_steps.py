"""`pool.mode = "local"` through real processes: stage servers of two replicas each, a trainer that
writes the route record, and the reference replaying it (`swarm local --routes`), float64 equal;
with a replica SIGKILLed mid-round too. The rule itself: tests/swarm/model/test_local_steps.py."""

from __future__ import annotations

import signal
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry
from safetensors.torch import load_file

from swarm.job.config import load_job
from swarm.local.procs import start_local_swarm
from swarm.model.local_steps import train_replicas
from swarm.model.routes import Join, Record, StepRuns, Sync, read_routes
from swarm.ops.faults import Fault, Point
from swarm.ops.progress import StepRecord
from tests.support.cli import swarm, swarm_forked
from tests.support.equality import (
    assert_no_member_skipped_a_round,
    assert_states_within,
    local_state,
)
from tests.support.jobs import write_job
from tests.support.servers import Servers, counted, train_on

LOCAL = {"mode": "local", "sync_every": 2}
RELAY = {"data_plane": "relay", "max_in_flight": 4}
# The rules whose replicas differ: (the [pool] table, the [training] keys it needs). "delayed":
# delayed_update's eager rule, rounds of one step (`swarm.job.rule`).
RULES: dict[str, tuple[dict[str, object], dict[str, object]]] = {
    "none": (LOCAL | {"overlap": "none"}, {}),
    "eager": (LOCAL | {"overlap": "eager"}, {}),
    "delayed": ({"overlap": "eager"}, {"delayed_update": True}),
}


def _train_through_a_kill(
    servers: Servers, routes: Path, victim: str
) -> tuple[dict[str, torch.Tensor], CollectorRegistry, list[Record]]:
    """Train, recording; `victim` must have died by SIGKILL (its fault)."""
    try:
        state, registry = train_on(servers, routes=routes)
    finally:
        servers.stop()
    record = list(read_routes(routes))
    # Its fault fires only where the wiring routed it a microbatch of the fault's step (once in
    # a CI run it did not): what each process said of the routing then, for the next such run.
    said = [
        f"{name}: {line}"
        for name, proc in servers.procs.items()
        for line in [x for x in proc.log().splitlines() if " WARNING " in x][-8:]
    ]
    routed = [
        f"step {r.step}: {[run.chain for run in r.runs]}" for r in record if isinstance(r, StepRuns)
    ]
    assert servers.procs[victim].proc.returncode == -signal.SIGKILL, "\n".join(routed + said)
    return state, registry, record


def _replayed(job: Path, routes: Path) -> dict[str, torch.Tensor]:
    return _replayed_records(job, list(read_routes(routes)))


def _replayed_records(job: Path, records: list[Record]) -> dict[str, torch.Tensor]:
    assert_no_member_skipped_a_round(records)  # what the replay, following the record, cannot
    model = train_replicas(load_job(job), routes=records)
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["none", "eager", "delayed"])
def test_local_steps_on_two_replicas_per_stage_equal_the_reference_replaying_their_routes(
    tmp_path: Path, rule: str
) -> None:
    """2 stages of 2 replicas, rounds of 2 steps over 5 steps (the last round is one step), on
    the relay plane (the push plane: the tests below): the swarm's parameters equal the
    reference replaying the record, and differ from per-step averaging (the replicas did train
    apart). With the eager overlap each round's sum runs while the next round trains; with
    delayed_update's eager rule a round is one step, its optimizer the job's."""
    pool, training = RULES[rule]
    job_training = {"steps": 5, "target_batch_size": 16, "stages": 2, "checkpoint_every": 0}
    job = write_job(tmp_path, training=job_training | training, runtime=RELAY, pool=pool)
    servers = Servers(job, [2, 2], [], tmp_path)
    routes = tmp_path / "routes.jsonl"
    records: list[StepRecord] = []
    try:
        state, _ = train_on(servers, records.append, routes=routes)
    finally:
        servers.stop()
    record = list(read_routes(routes))
    joins = [r for r in record if isinstance(r, Join)]
    assert {(j.stage, j.peer) for j in joins} == {(k, f"s{k}r{r}") for k in (0, 1) for r in (0, 1)}
    syncs = [r for r in record if isinstance(r, Sync)]
    ends = range(5) if rule == "delayed" else (1, 3, 4)
    assert [(s.step, s.stage) for s in syncs] == [(t, k) for t in ends for k in (0, 1)]
    steps = [r for r in record if isinstance(r, StepRuns)]
    assert [s.step for s in steps] == list(range(5))
    held = {run.chain[k] for s in steps for run in s.runs for k in run.stages}
    assert held == {"s0r0", "s0r1", "s1r0", "s1r1"}, "both replicas of each stage trained"
    assert_states_within(state, _replayed(job, routes), tol=1e-9)
    per_step = local_state(write_job(tmp_path, "step", training={"steps": 5, "stages": 2}))
    far = max((state[k] - v).abs().max().item() for k, v in per_step.items())
    assert far > 1e-6, far
    assert [r.step for r in records] == list(range(5))
    if rule == "eager":  # the other rule, on the same routes, ends elsewhere
        other = write_job(tmp_path, "plain", training=job_training, runtime=RELAY, pool=LOCAL)
        plain = _replayed(other, routes)
        far = max((state[k] - v).abs().max().item() for k, v in plain.items())
        assert far > 1e-6, far
    if rule == "delayed":  # and delayed_update's naive rule ends elsewhere
        naive = local_state(write_job(tmp_path, "naive", training=job_training | training))
        far = max((state[k] - v).abs().max().item() for k, v in naive.items())
        assert far > 1e-6, far


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["none", "eager", "delayed"])
def test_a_replica_killed_mid_round_drops_its_round_and_the_rest_stays_exact(
    tmp_path: Path, rule: str
) -> None:
    """s1r0 dies at a backward of step 3, the second step of the round [2, 3]: its step-3
    gradients are replayed on s1r1, its step-2 local update (applied, not averaged yet) is
    dropped with its samples (counted), and the reference replaying the record agrees. With
    the eager overlap the sum of round [0, 1] is under way meanwhile (it holds s1r0's share).
    With delayed_update's eager rule (rounds of one step) nothing of step 3 was applied: it is
    all replayed, and only a share of step 2 that the dead replica had not summed yet is lost."""
    pool, training = RULES[rule]
    job = write_job(
        tmp_path,
        training={"steps": 6, "target_batch_size": 16, "stages": 2, "checkpoint_every": 0}
        | training,
        runtime={"data_plane": "push", "max_in_flight": 4},
        pool=pool,
    )
    fault = Fault("s1r0", Point.BACKWARD, 3)
    # The survivor is 3x slower: the wiring gives the victim most of step 2, which it loses.
    servers = Servers(job, [2, 2], [fault], tmp_path, slow=frozenset({"s1r1"}))
    routes = tmp_path / "routes.jsonl"
    state, registry, record = _train_through_a_kill(servers, routes, "s1r0")
    step2 = next(r for r in record if isinstance(r, StepRuns) and r.step == 2)
    lost = sum(4 for run in step2.runs if 1 in run.stages and run.chain[1] == "s1r0")
    assert lost > 0
    syncs = {(r.step, r.stage): r for r in record if isinstance(r, Sync)}
    if rule == "delayed" and syncs[(3, 1)].averaged is None:
        lost = 0  # step 2's sum was done before the kill: nothing applied is lost
    assert counted(registry, "swarm_coordinator_round_dropped_samples_total") == lost
    after = [r for r in record if isinstance(r, Sync) and r.stage == 1 and r.step >= 3]
    assert after and all(s.group == ("s1r1",) for s in after)
    assert_states_within(state, _replayed(job, routes), tol=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["eager", "delayed"])
def test_eager_a_replica_killed_in_a_rounds_background_sum_leaves_its_share_out_exactly(
    tmp_path: Path, rule: str
) -> None:
    """pool.overlap = "eager": s1r0 dies while stage 1 sums the shares of round [0, 1] (in the
    background, as round [2, 3] trains): s1r1 sums again alone, so the average round [2, 3]'s
    outer step takes holds only its own share (the record says so: `averaged`), s1r0's samples
    of round [0, 1] are counted as dropped (its outer step was taken, its share is in no
    average), and the reference replaying the record equals the swarm. delayed_update's eager
    rule likewise with rounds of one step: the sum of step 1's shares, as step 2 trains."""
    pool, training = RULES[rule]
    job = write_job(
        tmp_path,
        training={"steps": 6, "target_batch_size": 16, "stages": 2, "checkpoint_every": 0}
        | training,
        runtime=RELAY,
        pool=pool,
    )
    servers = Servers(job, [2, 2], [Fault("s1r0", Point.AVERAGING, 2)], tmp_path)
    routes = tmp_path / "routes.jsonl"
    state, registry, record = _train_through_a_kill(servers, routes, "s1r0")
    summed, after = (1, 2) if rule == "delayed" else (0, 3)  # the lost sum's round, the next end
    first = [r for r in record if isinstance(r, StepRuns) and summed <= r.step < 2]
    lost = sum(4 for s in first for run in s.runs if 1 in run.stages and run.chain[1] == "s1r0")
    assert lost > 0
    assert counted(registry, "swarm_coordinator_round_dropped_samples_total") == lost
    syncs = {(r.step, r.stage): r for r in record if isinstance(r, Sync)}
    assert syncs[(1, 1)].group == ("s1r0", "s1r1") and syncs[(1, 1)].averaged is None
    assert syncs[(after, 1)].group == ("s1r1",) and syncs[(after, 1)].averaged == ("s1r1",)
    assert syncs[(after, 0)].averaged is None  # stage 0's sum went through
    assert_states_within(state, _replayed(job, routes), tol=1e-9)
    plain = [replace(r, averaged=None) if isinstance(r, Sync) else r for r in record]
    far = max((state[k] - v).abs().max().item() for k, v in _replayed_records(job, plain).items())
    assert far > 1e-6, far  # the record's `averaged` is what makes the two equal


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["none", "eager", "delayed"])
def test_a_restarted_replica_rejoins_at_a_rounds_start_as_a_copy_and_stays_exact(
    tmp_path: Path, rule: str
) -> None:
    """s0r0 dies at a backward of step 3 and comes back empty: it copies s0r1 while training
    goes on, follows its updates through a round's end, and becomes a member where a round
    starts; the record says so (a join from s0r1), and the reference replaying it agrees. With
    the eager overlap the copy takes its source's own start, outer momentum, last share and
    the round's sum (which the coordinator waits for where a copy joins)."""
    # 32 steps: on a busy machine the restarted process is up and copying only several steps
    # after the kill (the coordinator's join retries back off meanwhile); with 16 the job
    # sometimes ended first. Stage 1 is slow for the same reason.
    pool, training = RULES[rule]
    job = write_job(
        tmp_path,
        training={"steps": 32, "target_batch_size": 16, "stages": 2, "checkpoint_every": 0}
        | training,
        runtime={"data_plane": "relay", "max_in_flight": 4},
        pool=pool,
    )
    slow = frozenset({"s1r0", "s1r1"})
    servers = Servers(job, [2, 2], [Fault("s0r0", Point.BACKWARD, 3)], tmp_path, slow=slow)
    victim, restarted = servers.procs["s0r0"], []

    def chaos(record: StepRecord) -> None:
        if record.step == 3 and not restarted:
            restarted.append(record.step)
            servers.restart("s0r0")

    routes = tmp_path / "routes.jsonl"
    try:
        state, _ = train_on(servers, chaos, routes=routes)
    finally:
        servers.stop()
    assert victim.proc.returncode == -signal.SIGKILL and restarted
    record = list(read_routes(routes))
    rejoined = [r for r in record if isinstance(r, Join) and r.step > 0]
    assert [(j.stage, j.peer, j.source) for j in rejoined] == [(0, "s0r0", "s0r1")]
    assert rejoined[0].step % (1 if rule == "delayed" else 2) == 0, "joins where a round starts"
    held = {
        run.chain[0]
        for s in record
        if isinstance(s, StepRuns) and s.step >= rejoined[0].step
        for run in s.runs
    }
    assert "s0r0" in held, "the copy trained after it joined"
    assert_states_within(state, _replayed(job, routes), tol=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize(("rule", "checkpoint_every"), [("none", 0), ("eager", 2), ("delayed", 3)])
def test_under_a_scheduler_the_record_is_exported_and_swarm_local_replays_it(
    tmp_path: Path, rule: str, checkpoint_every: int
) -> None:
    """The scheduler's embedded trainer records the routes; `swarm export --routes` fetches them
    and `swarm local --routes` ends with the exported model's parameters. With the eager
    overlap and a checkpoint at every round's start, each round's sum is waited for there (a
    checkpoint holds every member's state whole) and the checkpoints are sealed."""
    pool, extra = RULES[rule]
    training = {"steps": 6, "target_batch_size": 16, "stages": 2}
    job = write_job(
        tmp_path,
        training=training | extra | {"checkpoint_every": checkpoint_every},
        pool=pool,
    )
    sw, _ = start_local_swarm([1.0, 1.0, 1.0, 1.0], log_dir=tmp_path)
    try:
        out = swarm("submit", str(job), "--wait", "--scheduler", sw.address).stdout
        assert "succeeded" in out, out
        job_id = out.split()[0]
        routes, model = tmp_path / "routes.jsonl", tmp_path / "swarm.pt"
        at = ("--scheduler", sw.address)
        # forked: an export imports torch, seconds of CPU a fresh interpreter spends first
        exported = ["--out", str(model), "--routes", str(routes), *at]
        swarm_forked("export", job_id, *exported, log_dir=tmp_path, name="export")
    finally:
        sw.stop()
    record = list(read_routes(routes))
    assert [r.step for r in record if isinstance(r, StepRuns)] == list(range(6))
    if checkpoint_every:  # sealed, with every eager tensor of each stage's state
        sealed = sorted(p.parent.name for p in (tmp_path / "ckpt").rglob("manifest.json"))
        assert sealed, "no checkpoint was sealed"
        newest = load_file(next((tmp_path / "ckpt").rglob(f"{sealed[-1]}/stage-0.safetensors")))
        assert any(k.startswith("share/") for k in newest), sorted(newest)
        assert any(k.startswith("average/") for k in newest), sorted(newest)
    # One torch thread, as the stage servers have: one per core (its default) only contends on
    # a busy machine.
    ref = ["--routes", str(routes), "--out", str(tmp_path / "ref.pt"), "--threads", "1"]
    swarm_forked("local", str(job), *ref, log_dir=tmp_path, name="ref")
    reference = torch.load(tmp_path / "ref.pt", weights_only=True)
    assert_states_within(torch.load(model, weights_only=True), reference, tol=1e-9)
