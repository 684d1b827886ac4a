"""A replica becomes a member only knowing the last rollback's epoch (`swarm.rpc.epoch`), or it
would take work leased before that rollback into the replayed step.

A replica that joins after a rollback got none of its LoadStates: the coordinator's Join tells
it the epoch, and it becomes a member only on the answer to a Join that said the epoch current
then (a Join sent before a rollback and answered after it said the old one, and is asked
again). A former member that missed a rollback's LoadState (it did not answer then) is not
re-admitted as holding its stage's state: what it holds is from before the rollback, which
loads it instead. (Before, no Join said an epoch, and `readmit` took any replica at the step.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

from swarm.errors import PeerUnavailable
from swarm.job.fingerprint import fingerprint
from tests.support.coordinator import Harness, MakeHarness, job_of, until
from tests.support.replicas import FakeReplica, FakeSwarm

_MISSED = PeerUnavailable("UNAVAILABLE: deadline exceeded")  # a LoadState it did not answer


async def _started(
    tmp_path: Path, make_harness: MakeHarness, *stage1: str
) -> tuple[Harness, list[FakeReplica]]:
    """A job at step 0: stage 0 has replica a, stage 1 those named `stage1` (returned)."""
    job = job_of(tmp_path, steps=5)
    swarm = FakeSwarm(fingerprint(job), 2)
    swarm.add(0, "a")
    replicas = [swarm.add(1, peer) for peer in stage1]
    h = make_harness(job, swarm)
    await h.coordinator.start()
    return h, replicas


async def test_a_join_answered_across_a_rollback_admits_only_with_the_rollbacks_epoch(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    h, _ = await _started(tmp_path, make_harness, "c")
    membership = h.coordinator.membership
    (stale, *_) = await h.lease()  # leased before the rollback
    m = h.swarm.add(1, "m")  # appears during step 0
    held = m.hold("join")
    m.fail("load_state", _MISSED)
    await membership.sync(0)  # the boundary: m is asked to Join, its answer held
    await held.entered.wait()
    h.coordinator.bans.roll_back_to(0)  # a ban's: every member loads step 0's state
    assert await h.rollbacks.get() == 0
    assert "m" not in membership.synced  # its load failed: it has no epoch of the rollback
    held.open()  # m answers its Join, sent with the epoch before: a copy at step 0
    await until(lambda: "m" in membership.synced)
    (fresh, *_) = await h.lease()
    assert stale.epoch < fresh.epoch
    # Before: admitted on that answer, m refused no work (its epoch 0), and would still have
    # taken `stale`'s calls; admitted on it with the epoch it said, it would take them too.
    assert m.epoch == fresh.epoch
    assert len(m.called("join")) >= 2  # asked again, with the rollback's epoch


async def test_a_replica_that_missed_a_rollbacks_state_is_loaded_not_re_admitted(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    h, (c, x) = await _started(tmp_path, make_harness, "c", "x")
    membership = h.coordinator.membership
    x.fail("load_state", _MISSED)
    h.coordinator.bans.roll_back_to(0)  # x does not answer its LoadState: left out
    assert await h.rollbacks.get() == 0
    assert "x" not in membership.synced and x.epoch == 0
    c.dead = True  # stage 1's last member goes: x, back, answers at the job's step
    membership.drop("c", "a test leaves it out")
    assert (await h.coordinator.lease("t", 8)).tasks == []  # stage 1 has no member
    await until(lambda: "x" in membership.synced)
    (fresh, *_) = await h.lease()
    # Before: re-admitted as it was (its epoch 0: it took work leased before the rollback,
    # its state the one from before it); now the rollback is tried again, and loads it.
    assert x.called("load_state") == [0, 0]
    assert x.epoch == fresh.epoch


async def test_a_peer_that_never_held_a_lost_stage_is_not_taken_as_its_holder(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    # z announces stage 1 and answers Info at the job's step, its epoch current, and was never
    # a member nor asked to copy one (a token holder's peer says what it likes). Before, a
    # stage with no member took any peer listed on it that answered so as its holder: z
    # became stage 1's only replica, holding whatever it held, ahead of any standby.
    h, (c,) = await _started(tmp_path, make_harness, "c")
    membership = h.coordinator.membership
    z = h.swarm.add(1, "z")
    c.dead = True  # stage 1's only member goes
    membership.drop("c", "a test leaves it out")
    assert (await h.coordinator.lease("t", 8)).tasks == []  # stage 1 has no member
    # lost: the checkpoint is loaded, z's state with it (before: z taken as it was, no rollback)
    assert await asyncio.wait_for(h.rollbacks.get(), 10) == 0, membership.synced
    assert z.called("load_state") == [0]
    await until(lambda: "z" in membership.synced)
