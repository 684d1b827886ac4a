"""A replica copying a member is asked as every step opens, not only by its own asks, which
pause for up to seconds (`Membership._ASK_CAP_S`) while a step may take a fraction of one: it
joins at the first step its copy reaches, and one whose source died is named another member
there. (The fault test whose source is SIGKILLed mid-download failed in CI: its joiner, named
the third replica only at its own next ask, was not asked again before the job ended.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler.coordinator.membership import Membership
from swarm.job.fingerprint import fingerprint
from tests.support.coordinator import Harness, MakeHarness, job_of, until
from tests.support.replicas import FakeSwarm


@pytest.fixture(autouse=True)
def own_asks_an_hour_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """After its first ask a joiner's own asks are an hour apart here, steps a few
    milliseconds: only the asks as steps open can admit it within a test."""
    monkeypatch.setattr(Membership, "_ASK_FIRST_S", 3600.0)
    monkeypatch.setattr(Membership, "_ASK_CAP_S", 3600.0)


async def _copying_the_first_of(
    tmp_path: Path, make_harness: MakeHarness, *members: str
) -> tuple[Harness, FakeSwarm]:
    """A job whose stage 1 has `members`, and a replica `m` that appears there during step 0:
    past the boundary, it is copying the first of them, its download still going."""
    job = job_of(tmp_path, steps=5)
    swarm = FakeSwarm(fingerprint(job), 2)
    swarm.add(0, "a")
    for peer in members:
        swarm.add(1, peer)
    h = make_harness(job, swarm)
    await h.coordinator.start()
    m = swarm.add(1, "m")
    m.copying = 1  # its first Join finds its download going
    await h.step()  # the boundary: m starts copying
    await until(lambda: m.called("join") == [f"fake:{members[0]}"])
    assert "m" not in h.coordinator.membership.synced
    return h, swarm


async def test_a_copy_still_downloading_at_its_first_ask_joins_as_the_next_step_opens(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    h, swarm = await _copying_the_first_of(tmp_path, make_harness, "c")
    await h.step()  # the next step opens: m is asked there, is at it, and is admitted
    await until(lambda: "m" in h.coordinator.membership.synced)
    m = swarm["m"]
    assert m.called("join") == ["fake:c", "fake:c"] and m.step == swarm["c"].step


async def test_a_joiner_whose_source_died_copies_another_member_from_the_next_step(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    h, swarm = await _copying_the_first_of(tmp_path, make_harness, "c", "d")
    swarm["c"].dead = True  # SIGKILLed while m downloads its state
    # The step's gradients land on d; c fails its PREPARE and is dropped, and the step commits
    # without it.
    await h.step(at={1: "d"})
    membership = h.coordinator.membership
    assert "c" not in membership.synced
    await until(lambda: "m" in membership.synced)
    m = swarm["m"]
    assert m.called("join")[-1] == "fake:d" and m.step == swarm["d"].step
