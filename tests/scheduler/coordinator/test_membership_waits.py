"""What a replica that serves its stage but is not a member yet waits for, as `swarm status`
shows it (issue 45, item 2): a step's end, then its copy; one that does not answer says so, with
when it is tried again; a member waits for nothing."""

from __future__ import annotations

from pathlib import Path

from scheduler.coordinator.replicas import StageReplica
from swarm.errors import FailedPrecondition, PeerUnavailable
from swarm.job.fingerprint import fingerprint
from swarm.rpc.lease import Replica
from tests.support.coordinator import Harness, MakeHarness, job_of, started, until
from tests.support.replicas import FakeSwarm


async def test_a_joiner_says_what_it_waits_for_until_it_is_a_member(tmp_path: Path) -> None:
    job = job_of(tmp_path, steps=5)
    swarm = FakeSwarm(fingerprint(job), 2)
    swarm.add(0, "a"), swarm.add(1, "c")
    h = Harness(job, swarm)
    try:
        await h.coordinator.start()
        swarm.add(0, "n")
        m = swarm.add(1, "m")
        m.fail("join", PeerUnavailable("UNAVAILABLE: failed to connect: Connection refused"))
        membership = h.coordinator.membership
        assert membership.waits() == {
            "n": "waiting for a step's end to download state from a",
            "m": "waiting for a step's end to download state from c",
        }
        await h.step()  # the boundary: n copies a and becomes a member; m does not answer
        await until(lambda: "n" in membership.synced and len(m.called("join")) == 1)
        await until(lambda: "not answering" in membership.waits().get("m", ""))
        [(peer, said)] = membership.waits().items()
        assert peer == "m" and said.startswith(
            "not answering at fake:m (UNAVAILABLE: Connection refused); trying again "
        ), said
        h.clock.advance(60)  # past its pause: tried again at the next step's end
        assert membership.waits()["m"].endswith("trying again at the next step's end")
        await h.step()
        await until(lambda: "m" in membership.synced)
        assert membership.waits() == {}
    finally:
        await h.coordinator.close()


async def test_a_joiner_that_did_not_answer_is_asked_again_over_a_new_connection(
    tmp_path: Path,
) -> None:
    """A gRPC channel that failed to connect fails every call until its own reconnect backoff
    ends: a peer restarted at the same address was asked again over it and refused each time
    (in CI a restarted replica never rejoined in 28 steps). The connection that failed is
    dropped, and the next ask dials anew."""
    job = job_of(tmp_path, steps=5)
    swarm = FakeSwarm(fingerprint(job), 2)
    swarm.add(0, "a"), swarm.add(1, "c")
    h = Harness(job, swarm)
    dialed: list[str] = []
    clients = h.coordinator.membership.clients
    factory = clients.factory

    def counted(stage: int, replica: Replica) -> StageReplica:
        dialed.append(replica.peer)
        return factory(stage, replica)

    clients.factory = counted
    try:
        await h.coordinator.start()
        m = swarm.add(1, "m")
        m.fail("join", PeerUnavailable("UNAVAILABLE: failed to connect: Connection refused"))
        membership = h.coordinator.membership
        await h.step()
        await until(lambda: "not answering" in membership.waits().get("m", ""))
        assert dialed.count("m") == 1
        h.clock.advance(60)  # restarted at the same address meanwhile (its failure was one)
        await h.step()
        await until(lambda: "m" in membership.synced)
        assert dialed.count("m") == 2, dialed
    finally:
        await h.coordinator.close()


async def test_a_joiner_that_refuses_its_join_says_why(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    """A Join refused (not a peer gone: it answered) was said in the log alone; status said
    the joiner waited "for a step's end to download state", at every boundary."""
    h = await started(tmp_path, make_harness, "a", "c", steps=5)
    m = h.swarm.add(1, "m")
    m.fail("join", FailedPrecondition("stage 1: a Join sent before the rollback: stale"))
    membership = h.coordinator.membership
    await h.step()
    await until(lambda: len(m.called("join")) == 1)
    await until(lambda: "failed" in membership.waits().get("m", ""))
    assert membership.waits()["m"] == (
        "its last Join failed (stage 1: a Join sent before the rollback: stale); asked again "
        "at the next step's end"
    )
    await h.step()  # asked again: it joins
    await until(lambda: "m" in membership.synced)
    assert membership.waits() == {}


async def test_where_made_up_peers_served_is_not_kept_once_they_are_gone(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    """Each peer listed as serving was kept with its stage for the coordinator's life: made-up
    ids passing through the scheduler's room (which bounds those present, not those that came)
    grew it by one each (a review of unbounded state found it)."""
    h = await started(tmp_path, make_harness, "a", "c")
    membership = h.coordinator.membership
    for i in range(200):
        h.swarm.add(0, f"sybil-{i}")
        h.coordinator.replicas()
        h.swarm.remove(f"sybil-{i}")
    await membership.sync(h.coordinator.ledger.step)  # type: ignore[union-attr]
    assert set(membership._stage_of) == {"a", "c"}


async def test_a_member_left_out_says_why(tmp_path: Path, make_harness: MakeHarness) -> None:
    """A member dropped was said "unreachable" in the log and "not answering (it stopped
    answering calls)" in status, whatever dropped it (a review found it): here one restarted
    empty, and one whose Info failed."""
    h = await started(tmp_path, make_harness, "a b", "c d", steps=5)
    membership = h.coordinator.membership
    await h.step()
    step = next(ledger.step for ledger in membership.ledgers())
    h.swarm["b"].step = step - 1  # restarted, at the same address, from a checkpoint
    h.swarm["d"].fail("info", PeerUnavailable("UNAVAILABLE: Connection reset by peer"))
    await membership.check(step)
    said = membership.waits()
    assert said["b"].startswith(
        f"left out: it answers at step {step - 1}, not {step} (restarted empty?); trying again"
    ), said
    assert said["d"].startswith(
        "left out: its Info failed (UNAVAILABLE: Connection reset by peer); trying again"
    ), said
    await h.coordinator.close()
