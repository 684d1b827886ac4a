"""A replica that joins after a rollback is told the coordinator's rollback epoch in its Join
(`swarm.rpc.epoch`): it got none of the rollback's LoadStates, and would otherwise take work
leased before the rollback into the replayed step. It becomes a member only on the answer to a
Join that said the epoch current then: a Join sent before a rollback and answered after it
said the old one, and is asked again. (Before, no Join said an epoch: a joiner admitted after a
rollback refused nothing.)"""

from __future__ import annotations

from pathlib import Path

from swarm.errors import PeerUnavailable
from swarm.job.fingerprint import fingerprint
from tests.support.coordinator import MakeHarness, job_of, until
from tests.support.replicas import FakeSwarm


async def test_a_join_answered_across_a_rollback_admits_only_with_the_rollbacks_epoch(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    job = job_of(tmp_path, steps=5)
    swarm = FakeSwarm(fingerprint(job), 2)
    swarm.add(0, "a")
    swarm.add(1, "c")
    h = make_harness(job, swarm)
    await h.coordinator.start()
    membership = h.coordinator.membership
    (stale, *_) = await h.lease()  # leased before the rollback
    m = swarm.add(1, "m")  # appears during step 0
    held = m.hold("join")
    m.fail("load_state", PeerUnavailable("UNAVAILABLE: fake:m: deadline exceeded"))
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
