"""The peers a job's rebalancer neither moves nor counts as replicas (`set_aside`): its standbys,
and the peers banned from it. A banned peer still serves its stage (nothing withdraws it), and
the rebalancer counted it: a stage it alone served looked served, and an honest replica could be
moved away from beside it (a review found it)."""

from __future__ import annotations

from pathlib import Path

from scheduler.coordinator.trust.standing import Ban
from swarm.job.fingerprint import fingerprint
from tests.support.coordinator import MakeHarness, job_of
from tests.support.replicas import FakeSwarm


class _Book:
    """A job's bans kept before this coordinator: b's."""

    binds_credentials = False

    def kept(self) -> list[Ban]:
        return [Ban("b", 1, 0, 0, "its contribution was off (a test's)", replayed=True)]

    def keep(self, ban: Ban) -> None:
        pass

    def seen(self) -> dict[str, int]:
        return {}

    def see(self, peer: str, step: int) -> None:
        pass


async def test_a_banned_peer_on_a_stage_is_set_aside_with_the_standbys(
    tmp_path: Path, make_harness: MakeHarness
) -> None:
    job = job_of(tmp_path)
    swarm = FakeSwarm(fingerprint(job), 2)
    swarm.add(0, "a"), swarm.add(1, "b"), swarm.add(1, "c")
    coordinator = make_harness(job, swarm, bans=_Book()).coordinator
    assert coordinator.set_aside() == {"b"}
    assert coordinator.barred([0, 1]) == {0: [], 1: ["b"]}
