"""Issue 54, H-rates: link rates as peers announce them size every pool's parts, so the
registry believes only plausible ones (`swarm.net.bandwidth.plausible_rate`), water-filling
bounds every member's share (`swarm.policy.parts.MAX_SHARE`), and a partition that cannot be
made is equal parts, not a failed round. The announcements go through the scheduler's own
registry, aggregator offer and round groups, wired as `scheduler.job_training` wires them.

Before: eight aggregators announcing 1e12 B/s took 100% of a pool; a replica announcing 1e12 B/s
owned its pool's whole vector; a NaN rate raised at every round (the job failed after 20
attempts); two aggregators at 1.7e308 B/s overflowed the sum (every pool of 3+ failed)."""

from __future__ import annotations

import math

import pytest

from scheduler.aggregators import offered
from scheduler.coordinator.groups import Aggregator, Groups, Link, RoundGroup, link_of
from scheduler.registry import PeerRegistry
from swarm.clock import FakeClock
from swarm.net.bandwidth import MAX_LINK_BYTES_PER_SECOND
from swarm.policy.parts import MAX_SHARE
from swarm.proto import control_pb2 as cpb
from swarm.rpc.lease import Replica

pytestmark = [pytest.mark.timeout(30), pytest.mark.attack("H-rates")]

MBIT = 1e6 / 8


def _announce(
    reg: PeerRegistry, peer: str, rate: float, role: int = cpb.PEER_ROLE_STAGE_SERVER
) -> None:
    reg.announce(
        cpb.PeerAnnouncement(
            peer=peer,
            address=f"{peer}:7000",
            job="j" if role == cpb.PEER_ROLE_STAGE_SERVER else "",
            state=cpb.PEER_STATE_SERVING,
            role=role,  # type: ignore[arg-type]
            upload_bytes_per_second=rate,
            download_bytes_per_second=rate,
        )
    )


def _scheduler() -> tuple[PeerRegistry, Groups]:
    reg = PeerRegistry(FakeClock(), load_silence_s=10.0, serve_timeout_s=300.0)
    groups = Groups(
        lambda peer: link_of(reg.peers.get(peer)),
        offered(reg.peers, lambda a: Aggregator(a.peer, a.address, Link(a.rate))),
    )
    return reg, groups


def _pool(reg: PeerRegistry, rates: list[float]) -> list[Replica]:
    names = [f"r{i}" for i in range(len(rates))]
    for name, rate in zip(names, rates, strict=True):
        _announce(reg, name, rate)
    return [Replica(name, f"{name}:7000") for name in names]


def _shares(group: RoundGroup) -> list[float]:
    n = len(group.members)
    return list(group.parts.weights) or [1.0 / n] * n


def test_eight_aggregators_at_1e12_take_no_more_than_their_bound() -> None:
    reg, groups = _scheduler()
    replicas = _pool(reg, [100 * MBIT] * 3)
    for k in range(8):
        _announce(reg, f"agg{k}", 1e12, cpb.PEER_ROLE_AGGREGATOR)
    shares = _shares(groups.of(0, replicas))
    assert len(shares) == 3 + 8 and math.fsum(shares) == pytest.approx(1.0)
    # Past the ceiling the rate is not known: equal parts, the replicas keep theirs.
    assert shares == pytest.approx([1 / 11] * 11)
    assert reg.peers["agg0"].upload_bytes_per_second == 0.0


def test_a_replica_at_the_ceiling_owns_at_most_its_bound() -> None:
    reg, groups = _scheduler()
    replicas = _pool(reg, [10 * MBIT, 20 * MBIT, 30 * MBIT, MAX_LINK_BYTES_PER_SECOND])
    shares = _shares(groups.of(0, replicas))
    assert max(shares) <= MAX_SHARE / 4 and math.fsum(shares) == pytest.approx(1.0)
    replicas = _pool(reg, [10 * MBIT, 20 * MBIT, 30 * MBIT, 1e12])  # past it: not known
    assert _shares(groups.of(0, replicas)) == pytest.approx([0.25] * 4)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -5.0, 1.7e308])
def test_a_rate_not_finite_or_huge_leaves_equal_parts_not_a_failed_round(bad: float) -> None:
    reg, groups = _scheduler()
    replicas = _pool(reg, [10 * MBIT, bad, 30 * MBIT])
    assert _shares(groups.of(0, replicas)) == pytest.approx([1 / 3] * 3)
    _announce(reg, "agg-a", 1.7e308, cpb.PEER_ROLE_AGGREGATOR)
    _announce(reg, "agg-b", 1.7e308, cpb.PEER_ROLE_AGGREGATOR)
    shares = _shares(groups.of(0, _pool(reg, [10 * MBIT, 20 * MBIT, 30 * MBIT])))
    assert all(math.isfinite(w) for w in shares) and math.fsum(shares) == pytest.approx(1.0)


def test_the_partition_falls_back_to_equal_parts_whatever_reaches_it() -> None:
    """A rate that got past the registry (a link function of another making) is equal parts."""
    groups = Groups(lambda peer: Link(math.nan if peer == "b" else 5.0))
    group = groups.of(0, [Replica(p, f"{p}:1") for p in "abc"])
    assert _shares(group) == pytest.approx([1 / 3] * 3)
