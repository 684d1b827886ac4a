"""Faults as data against real stage-server processes killed with SIGKILL: every run must end
with `swarm local`'s parameters (float64, within 1e-9), and the counters must show what happened."""

from __future__ import annotations

import os
import random
import re
import signal
import threading
from pathlib import Path

import pytest

from swarm.ops.faults import Fault, Point
from swarm.ops.progress import StepRecord
from tests.support.equality import (
    assert_equal_to_local,
    evaluations,
    local_evaluations,
    local_state,
)
from tests.support.jobs import DELAYED, write_job
from tests.support.servers import Servers, counted, train_on
from tests.support.waiting import wait_until_blocking

pytestmark = pytest.mark.slow
WHERE = {"first": 0, "middle": 1, "last": 3}
# A joiner's copy ended: loaded ("copied stage 3 at step 2 from ADDRESS") or failed.
_COPY_ENDED = re.compile(r"copied stage \d+ at step \d+ from |: copying \S+ failed: ")


def _a_victim_and_a_slow_survivor(
    tmp_path: Path, point: Point, where: str, data_plane: str
) -> tuple[Path, Fault, Servers]:
    """A 5-step job; one replica per stage, two at `where`'s stage: `s{stage}r0` dies at `point`
    of step 2, and the survivor is 3x slower, so the wiring gives the victim most of the work:
    when it dies it holds accepted gradients, and their replay is what the counters must show."""
    stage = WHERE[where]
    job = write_job(
        tmp_path,
        training={"steps": 5, "target_batch_size": 16},
        runtime={"data_plane": data_plane},
    )
    fault = Fault(f"s{stage}r0", point, 2)
    layout = [2 if k == stage else 1 for k in range(4)]
    servers = Servers(job, layout, [fault], tmp_path, slow=frozenset({f"s{stage}r1"}))
    return job, fault, servers


@pytest.mark.parametrize("where", sorted(WHERE))
@pytest.mark.parametrize("point", [Point.FORWARD, Point.BACKWARD, Point.AVERAGING, Point.IDLE])
def test_replica_killed_at_each_point(tmp_path: Path, point: Point, where: str) -> None:
    # The relay plane: the trainer makes every hop, and its counters show each one.
    job, fault, servers = _a_victim_and_a_slow_survivor(tmp_path, point, where, "relay")
    victim = servers.procs[fault.target]

    def kill_when_idle(record: StepRecord) -> None:
        if point == Point.IDLE and record.step + 1 == fault.step:  # between steps 1 and 2
            victim.kill()

    try:
        state, registry = train_on(servers, kill_when_idle)
    finally:
        servers.stop()
    assert victim.proc.returncode == -signal.SIGKILL, "the fault must have killed the replica"
    assert_equal_to_local(job, state, tol=1e-9)
    retries = counted(registry, "swarm_trainer_hop_failures_total")
    replays = counted(registry, "swarm_coordinator_replays_total")
    aborted = counted(registry, "swarm_coordinator_aborted_rounds_total")
    dropped = counted(registry, "swarm_coordinator_dropped_replicas_total")
    assert dropped >= 1 or retries >= 1, (retries, replays, aborted, dropped)
    if point in (Point.FORWARD, Point.BACKWARD):
        # The hop in flight failed and went to the survivor. (At BACKWARD the victim dies with
        # that microbatch accumulated but never reported: nothing accepted is lost, so nothing
        # needs replaying; the survivor's gradient is the one that counts.)
        assert retries >= 1
    if point == Point.AVERAGING:
        # It died in the round holding step 2's accepted gradients: the round aborted, and
        # those microbatches were replayed on the survivor, from the trainer's cached boundary
        # tensors (one call each, no pipeline).
        assert aborted >= 1 and replays >= 1
        assert counted(registry, "swarm_trainer_cached_replays_total") >= 1


@pytest.mark.parametrize(
    ("point", "where"),
    [(Point.FORWARD, "middle"), (Point.BACKWARD, "last"), (Point.AVERAGING, "first")],
)
def test_push_plane_replica_killed_with_microbatches_in_its_hands(
    tmp_path: Path, point: Point, where: str
) -> None:
    """The push plane: the replica dies with pushed microbatches in flight through it. The
    stage before it tries the survivor; the stages the dead call may have reached are reported
    uncertain and replayed; the result is exact."""
    job, fault, servers = _a_victim_and_a_slow_survivor(tmp_path, point, where, "push")
    victim = servers.procs[fault.target]
    try:
        state, registry = train_on(servers)
    finally:
        servers.stop()
    assert victim.proc.returncode == -signal.SIGKILL, "the fault must have killed the replica"
    assert_equal_to_local(job, state, tol=1e-9)
    replays = counted(registry, "swarm_coordinator_replays_total")
    unreported = counted(registry, "swarm_trainer_unreported_stages_total")
    if point == Point.AVERAGING:  # it died holding accepted gradients: they were replayed
        assert replays >= 1, (replays, unreported)
    else:  # the stage before it saw the push fail: the stages it may have reached went unreported
        assert unreported >= 1, (replays, unreported)
    assert counted(registry, "swarm_trainer_cached_replays_total") == 0  # push keeps no boundary


@pytest.mark.parametrize("where", sorted(WHERE))
def test_source_killed_while_a_replica_downloads_its_state(tmp_path: Path, where: str) -> None:
    # A replica of the stage is killed after step 0 and restarted empty: at the next step
    # boundary (step 2's) it starts copying a live replica of its stage. The first source dies
    # while streaming its state; as the next step opens the joiner is named the third replica,
    # copies it, and is admitted as a later step opens.
    stage = WHERE[where]
    steps = 10
    job = write_job(tmp_path, training={"steps": steps, "target_batch_size": 16})
    # The copy runs beside training: its download reaches the source at whatever step the
    # source is at by then, step 2 or, when the joiner is slow to start it, a later one. The
    # source dies at the first download it serves from step 2 on (it serves no other).
    source, joiner, killed = f"s{stage}r1", f"s{stage}r0", threading.Event()
    faults = [Fault(source, Point.STATE_DOWNLOAD, step) for step in range(2, steps)]
    servers = Servers(job, [3 if k == stage else 1 for k in range(4)], faults, tmp_path)

    def copy_settled() -> bool:
        """Whether the joiner's latest copy loaded or failed (or none was started)."""
        log = servers.procs[joiner].log()
        started = [m.end() for m in re.finditer(rf"copying stage {stage} from (\S+) ", log)]
        return not started or bool(_COPY_ENDED.search(log, started[-1]))

    def chaos(record: StepRecord) -> None:
        if record.step == 0 and not killed.is_set():
            servers.procs[joiner].kill()
            killed.set()
            servers.restart(joiner)
        # Steps here take a fraction of a second, and the copy runs beside them: a joiner
        # slowed by a loaded machine would see the job end first. A copy needs no coordinator,
        # so the job waits at a step's end until the joiner's latest copy is done either way.
        wait_until_blocking(copy_settled, "the joiner's copy loaded or failed", every_s=0.01)

    try:
        state, _ = train_on(servers, chaos)
    finally:
        servers.stop()
    assert servers.procs[source].proc.returncode == -signal.SIGKILL
    assert f"joined stage {stage} at step" in servers.procs[joiner].log()
    assert_equal_to_local(job, state, tol=1e-9)


def test_chaos_random_replicas_killed_and_restarted(tmp_path: Path) -> None:
    """30+ steps; now and then a random replica is SIGKILLed and restarted a little later."""
    job = write_job(tmp_path, training={"steps": 32, "target_batch_size": 16})
    servers = Servers(job, [2, 2, 2, 2], [], tmp_path)
    rng, down, kills = random.Random(7), {}, []

    def chaos(record: StepRecord) -> None:
        for name, at in list(down.items()):  # bring back what has been down two steps
            if record.step >= at + 2:
                servers.restart(name)
                del down[name]
        if record.step % 4 == 1 and record.step < 28:
            stage = rng.randrange(4)
            alive = [f"s{stage}r{r}" for r in range(2) if f"s{stage}r{r}" not in down]
            if len(alive) == 2:  # never the last live replica of a stage
                name = rng.choice(alive)
                os.kill(servers.procs[name].proc.pid, signal.SIGKILL)
                servers.procs[name].proc.wait()
                down[name] = record.step
                kills.append(name)

    try:
        state, registry = train_on(servers, chaos)
    finally:
        servers.stop()
    assert len(kills) >= 4, kills
    assert counted(registry, "swarm_coordinator_dropped_replicas_total") >= 1
    assert_equal_to_local(job, state, tol=1e-9)


def test_stage_wiped_out_rolls_back_to_the_last_checkpoint(tmp_path: Path) -> None:
    # Stage 2 has one replica; it is killed after step 4 and comes back empty. Nothing at stage 2
    # holds step 5's parameters any more, so every stage rolls back to the checkpoint of step 4
    # and training carries on from there: the result is still exact.
    job = write_job(tmp_path, training={"steps": 8, "target_batch_size": 16, "checkpoint_every": 2})
    servers = Servers(job, [1, 1, 1, 1], [], tmp_path)
    done = threading.Event()

    def wipe_out(record: StepRecord) -> None:
        if record.step == 4 and not done.is_set():
            done.set()
            servers.procs["s2r0"].kill()
            servers.restart("s2r0")

    try:
        state, registry = train_on(servers, wipe_out, tmp_path / "ckpt")
    finally:
        servers.stop()
    assert counted(registry, "swarm_coordinator_rollbacks_total") == 1
    assert "a rollback" in servers.procs["s1r0"].log()  # the others rolled back too
    assert_equal_to_local(job, state, tol=1e-9)


def test_a_checkpoint_that_cannot_be_written_does_not_stop_training(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The checkpoint directory lies under a regular file: every save fails with an OSError.
    job = write_job(tmp_path, training={"steps": 4, "target_batch_size": 16, "checkpoint_every": 2})
    (tmp_path / "a-file").write_text("not a directory")
    servers = Servers(job, [1, 1, 1, 1], [], tmp_path)
    try:
        state, _ = train_on(servers, checkpoint_dir=tmp_path / "a-file" / "ckpt")
    finally:
        servers.stop()
    assert "checkpoint of step 2 not written" in caplog.text
    assert "checkpoint of step 4 not written" in caplog.text
    assert_equal_to_local(job, state, tol=1e-9)


def test_without_the_boundary_cache_replays_rerun_the_pipeline(tmp_path: Path) -> None:
    job = write_job(
        tmp_path,
        training={"steps": 4, "target_batch_size": 16},
        runtime={"boundary_cache_bytes": 0, "data_plane": "relay"},  # the cache is the relay's
    )
    fault = Fault("s1r0", Point.AVERAGING, 2)
    servers = Servers(job, [1, 2, 1, 1], [fault], tmp_path, slow=frozenset({"s1r1"}))
    try:
        state, registry = train_on(servers)
    finally:
        servers.stop()
    assert counted(registry, "swarm_coordinator_replays_total") >= 1
    assert counted(registry, "swarm_trainer_cached_replays_total") == 0  # no cache: full pipeline
    assert_equal_to_local(job, state, tol=1e-9)


RECIPE = {"schedule": "cosine", "warmup_steps": 2, "min_lr": 1e-3}
RECIPE_TRAINING = {"steps": 14, "target_batch_size": 16, "checkpoint_every": 2}
# Per rule: its [training] keys, and the jobs (name, [training], [optimizer]) that must end
# elsewhere, so that no part of the recipe (the clipping, the schedule, the staleness) is idle.
RECIPE_RULES = {
    "sync": (
        {},
        [
            ("unclipped", RECIPE_TRAINING, RECIPE),
            ("constant", RECIPE_TRAINING | {"grad_clip": 0.3}, {}),
        ],
    ),
    "delayed": (DELAYED, [("sync", RECIPE_TRAINING | {"grad_clip": 0.3}, RECIPE)]),
}


@pytest.mark.parametrize("rule", sorted(RECIPE_RULES))
def test_a_recipe_job_stays_exact_through_a_kill_a_rejoin_and_a_rollback(
    tmp_path: Path, rule: str
) -> None:
    """A warm-up then cosine learning rate and global-norm clipping that bites: the schedule
    is a function of the step and the coefficient travels with each update, so a replay (s1r0
    dies averaging step 2), a copy that follows its source's updates (s1r0 restarted after step
    2, admitted a few steps later) and a rollback (stage 2's only replica wiped out once s1r0 is
    back) all stay exact. With delayed_update too: the copy carries the parameters the open step
    computes on, and so does the checkpoint every stage rolls back to."""
    keys, elsewhere = RECIPE_RULES[rule]
    training = RECIPE_TRAINING | {"grad_clip": 0.3} | keys
    job = write_job(tmp_path, training=training, optimizer=RECIPE)
    fault = Fault("s1r0", Point.AVERAGING, 2)
    servers = Servers(job, [1, 2, 1, 1], [fault], tmp_path, slow=frozenset({"s1r1"}))
    victim, done = servers.procs["s1r0"], set[str]()

    def chaos(record: StepRecord) -> None:
        if record.step == 2 and "restart" not in done:
            done.add("restart")
            servers.restart("s1r0")
        elif done == {"restart"} and "joined stage 1 at step" in servers.procs["s1r0"].log():
            done.add("wipe")
            servers.procs["s2r0"].kill()
            servers.restart("s2r0")

    try:
        state, registry = train_on(servers, chaos, tmp_path / "ckpt")
    finally:
        servers.stop()
    assert victim.proc.returncode == -signal.SIGKILL
    assert done == {"restart", "wipe"}, "s1r0 must have joined before the job ended"
    assert counted(registry, "swarm_coordinator_replays_total") >= 1
    assert counted(registry, "swarm_coordinator_rollbacks_total") == 1
    assert counted(registry, "swarm_coordinator_grad_norm") > 0
    assert_equal_to_local(job, state, tol=1e-9)
    # Neither the clipping nor the schedule (nor the staleness) is idle: without it the result
    # differs.
    for name, other_training, optimizer in elsewhere:
        other = write_job(tmp_path, name, training=other_training, optimizer=optimizer)
        far = max((state[k] - v).abs().max().item() for k, v in local_state(other).items())
        assert far > 1e-4, far


@pytest.mark.parametrize("data_plane", ["push", "relay"])
def test_a_llama_recipe_with_evaluations_stays_exact_through_a_kill(
    tmp_path: Path, data_plane: str
) -> None:
    """The recipe of a real model (Llama blocks, warm-up then cosine, clipping that bites) on 4
    stages of 2 replicas, evaluated every 3 steps: a replica of stage 2 dies at the first
    forward of step 3, the step whose validation microbatches run beside its training ones. The
    parameters and every validation loss equal `swarm local`'s."""
    job = write_job(
        tmp_path,
        model={"kind": "llama", "n_heads": 2, "n_kv_heads": 1},
        training={
            "steps": 8,
            "target_batch_size": 16,
            "grad_clip": 0.3,
            "eval_every": 3,
            "eval_microbatches": 3,
        },
        optimizer={"schedule": "cosine", "warmup_steps": 2, "min_lr": 1e-3},
        runtime={"data_plane": data_plane},
    )
    # s2r1 is 3x slower, so the wiring sends s2r0 the first forward of every step at stage 2
    # (with equal speeds one slow measurement of s2r0 could leave it idle through step 3).
    fault = [Fault("s2r0", Point.FORWARD, 3)]
    servers = Servers(job, [2, 2, 2, 2], fault, tmp_path, slow=frozenset({"s2r1"}))
    victim, records = servers.procs["s2r0"], list[StepRecord]()
    try:
        state, registry = train_on(servers, records.append)
    finally:
        servers.stop()
    assert victim.proc.returncode == -signal.SIGKILL
    assert_equal_to_local(job, state, tol=1e-9)
    evals, expected = evaluations(records), local_evaluations(job)
    assert [s for s, _ in evals] == [s for s, _ in expected] == [0, 3, 6, 8]
    for (_, a), (_, b) in zip(evals, expected, strict=True):
        assert a is not None and b is not None and abs(a - b) <= 1e-9 * b
    assert counted(registry, "swarm_coordinator_val_loss") == evals[-1][1]
