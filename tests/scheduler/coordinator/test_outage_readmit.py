"""A home outage during a commit (issue 51, item 2: "serving peers show joining"): two replicas
of one home miss the commit's deadline together and are dropped, one the only replica of its
stage, the other one of two of another stage. The job stalls until the home is back; then both
still hold their stage's state at the step the job stalled at. Both count again as they are
(DESIGN's field rule: a replica that missed a deadline but answers at the ledger's step is
re-admitted), their gradients of the step discarded and replayed. Before, only the replica of
the empty stage was re-admitted: the other was shown joining and made to download, from a
member, the state it held all along."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from scheduler.coordinator.discards import Discards
from swarm.errors import PeerUnavailable, ResourceExhausted, SwarmError
from swarm.job.fingerprint import fingerprint
from swarm.rpc.lease import Task
from tests.support.coordinator import Harness, MakeHarness, job_of
from tests.support.replicas import FakeReplica, FakeSwarm
from tests.support.waiting import wait_until

Told = tuple[int, str, str]  # (stage, peer, text): what a `Discards.said` hook is told


async def test_both_replicas_of_a_home_back_from_an_outage_count_again_without_a_copy(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    job = job_of(tmp_path, steps=5)
    swarm = FakeSwarm(fingerprint(job), 2)
    a, b, c = swarm.add(0, "a"), swarm.add(0, "b"), swarm.add(1, "c")
    h = make_harness(job, swarm)
    await h.coordinator.start()
    await h.step()
    # Step 1: the home of b and c goes dark in the commit; both are dropped.
    out = PeerUnavailable("DEADLINE_EXCEEDED: deadline exceeded")
    b.fail("prepare", out)
    c.fail("prepare", out)
    for task in await h.lease():
        await h.run(task)
    replay = await h.lease()
    assert {t.step for t in replay} == {1} and h.rollbacks.empty()
    membership = h.coordinator.membership
    # Both are members again, as they were: nothing to copy, nothing to wait for.
    assert [[r.peer for r in s] for s in h.coordinator.replicas()] == [["a", "b"], ["c"]]
    assert membership.waits() == {}
    assert b.called("discard") == [1] and c.called("discard") == [1]
    for task in replay:
        await h.run(task)
    assert (await asyncio.wait_for(h.steps.get(), 10)).step == 1
    await h.step()  # the next boundary: b is asked to copy nobody
    assert not b.called("join") and not a.called("load_state")
    assert (a.step, b.step, c.step) == (3, 3, 3)


async def test_a_replica_whose_path_changed_as_its_stage_was_lost_is_readmitted_not_rolled_back(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    """A stage's only replica is behind NAT and its relay dies in the commit: it is dropped, and
    re-attaches to another relay at once. The rollback's readmission asked it over the dead
    path (no answer); its look for silent stages a moment later, over the new one, found it
    answering, so it rolled every stage back to the checkpoint, the state the replica held
    thrown away (CI: test_relay_failover, "a rollback while another path existed"). Stages are
    judged silent first, then readmitted: it counts again, with no rollback."""
    h, c, _ = await _only_replica_dropped(tmp_path, make_harness, info=[_NO_PATH])
    replay = await _lease_after_backoffs(h)
    assert {t.step for t in replay} == {1}
    assert h.rollbacks.empty(), "rolled back while the replica held its state"
    assert [[r.peer for r in s] for s in h.coordinator.replicas()] == [["a"], ["c"]]
    assert not c.called("load_state")


async def _lease_after_backoffs(h: Harness, tries: int = 20) -> list[Task]:
    """The next tasks, the clock moved past the rollback's backoff between looks (a try that
    found a stage silent waits; the next comes at a lease after its backoff)."""
    for _ in range(tries):
        for _ in range(50):
            lease = await h.coordinator.lease("t", 8)
            if lease.tasks:
                return lease.tasks
            await asyncio.sleep(0.001)
        h.clock.advance(1.0)
    raise AssertionError("no work was leased")


async def test_a_discard_lost_on_its_way_is_not_a_rollback(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    """The readmission found a stage's only replica answering at the job's step, but the Discard
    that makes it a member again got no answer (its relay died between the two calls, and it
    re-attached to another at once). It was read as a refusal: the stage was declared lost and
    every stage rolled back to the checkpoint, the state the replica held thrown away. A Discard
    that never reached the replica leaves the stage waiting for the next try, which re-admits
    it. The wait is said for the job's history (`swarm status`), with its cause."""
    h, c, said = await _only_replica_dropped(tmp_path, make_harness, discard=[_NO_PATH])
    replay = await _lease_after_backoffs(h)
    assert {t.step for t in replay} == {1}
    assert h.rollbacks.empty(), "rolled back while the replica held its state"
    assert said == [
        (
            1,
            "c",
            f"stage 1: c answers at step 1 but its discard got no answer ({_NO_PATH}): "
            "the stage is not lost, and waits for the next try (2 of 4)",
        )
    ]
    assert c.called("discard") == [1, 1]
    assert [[r.peer for r in s] for s in h.coordinator.replicas()] == [["a"], ["c"]]
    assert not c.called("load_state")


async def test_a_discard_that_never_reaches_the_replica_ends_in_a_rollback_said_why(
    tmp_path: Path, make_harness: MakeHarness, caplog: pytest.LogCaptureFixture
) -> None:
    """A replica that answers Info at the step but whose Discard never gets through is waited
    for a bounded number of tries (`Discards.TRIES`), then the stage is lost and the job rolls
    back, as it did at once before, the log saying why."""
    tries = Discards.TRIES
    with caplog.at_level(logging.WARNING):
        h, c, said = await _only_replica_dropped(tmp_path, make_harness, discard=[_NO_PATH] * tries)
        deadline = time.monotonic() + 60.0
        while h.rollbacks.empty() and time.monotonic() < deadline:
            await h.coordinator.lease("t", 8)  # a lease with a stage memberless tries again
            await asyncio.sleep(0.01)
            h.clock.advance(0.5)  # past the rollback's backoff, in time
    assert c.called("discard") == [1] * tries
    assert not h.rollbacks.empty(), "no rollback: the stage waited for good"
    assert f"discard got no answer {tries} times" in caplog.text
    texts = [text for _, _, text in said]
    assert len(texts) == tries and texts[-1].startswith(
        f"stage 1: c not re-admitted: its discard got no answer {tries} times, the last: "
    )


async def test_a_refused_discard_is_said_with_its_cause(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    """A Discard the replica refuses leaves it out at once, and its cause is said for the job's
    history, as the rollback that follows is."""
    refused = SwarmError("FAILED_PRECONDITION: not at step 1")
    h, c, said = await _only_replica_dropped(tmp_path, make_harness, discard=[refused])
    await _lease_after_backoffs(h)
    assert c.called("discard") == [1] and not h.rollbacks.empty()
    assert said == [(1, "c", f"stage 1: c not re-admitted (discard failed): {refused}")]


async def test_a_rollback_that_waits_for_a_silent_stage_says_so_once(
    tmp_path: Path, make_harness: MakeHarness, caplog: pytest.LogCaptureFixture
) -> None:
    """A rollback that finds a stage with no replica answering waits for one (loading the
    checkpoint elsewhere could not finish), and tries again after its backoff. The wait is said
    at WARNING and in the job's status once, with the stages it waits for, and its later tries
    at INFO. Before, every try said it at INFO alone: a job stalled this way read as running."""
    status: list[str] = []
    with caplog.at_level(logging.INFO):
        on_status = {"on_status": status.append}
        h, _, _ = await _only_replica_dropped(
            tmp_path, make_harness, on_status, info=[_NO_PATH] * 3
        )
        replay = await _lease_after_backoffs(h)
    assert {t.step for t in replay} == {1} and h.rollbacks.empty()
    waits = [r for r in caplog.records if "rollback waits" in r.getMessage()]
    assert len(waits) >= 2, [r.getMessage() for r in waits]  # each try that found it silent
    assert [r.levelno for r in waits] == [logging.WARNING] + [logging.INFO] * (len(waits) - 1)
    said = [s for s in status if "rollback waits" in s]
    assert said == ["rollback waits: no replica of stage 1 answers; it goes on once one does"]


async def test_a_wait_the_status_could_not_take_still_waits(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    """The job's status failing to take the wait's news (a full disk, the bus away) is logged;
    the rollback waits and goes on as before, where it failed the job."""

    def refuses(text: str) -> None:
        raise OSError("No space left on device")

    h, _, _ = await _only_replica_dropped(
        tmp_path, make_harness, {"on_status": refuses}, info=[_NO_PATH] * 2
    )
    replay = await _lease_after_backoffs(h)
    assert {t.step for t in replay} == {1} and h.rollbacks.empty()


async def test_a_rollback_no_replica_of_a_stage_can_load_says_why_in_status(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    """Stage 1's only replica refuses every LoadState (out of memory, say): the rollback tried
    again every backoff for good, its cause in the log per replica, and status said the
    stall's generic words. Now status says which stage loads nothing, and why, once while it
    stays so."""
    job = job_of(tmp_path, steps=5)
    swarm = FakeSwarm(fingerprint(job), 2)
    swarm.add(0, "a")
    c = swarm.add(1, "c")
    status: list[str] = []
    h = make_harness(job, swarm, on_status=status.append)
    await h.coordinator.start()
    # its words change at each try (the memory free then): said once all the same
    full = [ResourceExhausted(f"out of device memory ({n} MiB free)") for n in (1, 2, 3)]
    c.fail("load_state", *full)
    h.coordinator.bans.roll_back_to(0)
    # Three tries take 3.5 s of the rollback's backoff by themselves (0.5 + 1 + 2): `until`'s
    # 5 s left 1.5 s for the rest on a loaded machine, and a full suite beside it ran out.
    await wait_until(lambda: len(c.called("load_state")) >= 3, "three loads", timeout_s=30.0)
    said = [s for s in status if "load" in s]
    assert said == [
        "rollback to step 0: no replica of stage 1 loaded its state (c: out of device memory "
        "(1 MiB free)); tried again"
    ], status
    assert await h.rollbacks.get() == 0  # c loads it once it can


async def _only_replica_dropped(
    tmp_path: Path,
    make_harness: MakeHarness,
    coordinator: dict[str, Any] | None = None,
    **unanswered: list[SwarmError],
) -> tuple[Harness, FakeReplica, list[Told]]:
    """Stage 1's only replica, c, dropped in step 1's commit (its relay died), its next calls of
    each method in `unanswered` failing with those errors, one each; the step's work run. The
    list: what the Discards say for the job's history, as they say it. `coordinator`: the
    coordinator's own arguments."""
    said: list[Told] = []
    job = job_of(tmp_path, steps=4)
    swarm = FakeSwarm(fingerprint(job), 2)
    swarm.add(0, "a")
    c = swarm.add(1, "c")
    h = make_harness(job, swarm, **(coordinator or {}))
    h.coordinator.membership.discards.said.append(lambda *told: said.append(told))
    await h.coordinator.start()
    await h.step()
    c.fail("prepare", PeerUnavailable("UNAVAILABLE: Stream removed (Connection reset by peer)"))
    for method, errors in unanswered.items():
        c.fail(method, *errors)
    for task in await h.lease():
        await h.run(task)
    return h, c, said


# A call over the path a dead relay left: refused at connect, it never reached the replica.
_NO_PATH = PeerUnavailable("UNAVAILABLE: failed to connect: the dead relay's path")
