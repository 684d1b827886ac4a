"""Failure domains at the scheduler (issue 51, item 5): with a real broker and scheduler, and
stage servers announcing their hosts, a stage's two replicas land on distinct hosts when spares
allow (placement alone put both on one machine), and a stage whose replicas all sit behind one
router is a warning in the job's status."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from scheduler.failure_domains import domains_of
from swarm.proto import control_pb2 as cpb
from tests.support.jobs import BASE, render
from tests.support.scheduled import AMQTT_LEAKS, WAIT_S, scheduled_swarm
from tests.support.waiting import wait_until

SPEC = render(
    {
        **BASE,
        "training": {**BASE["training"], "stages": 2, "steps": 100_000},
        "runtime": {**BASE.get("runtime", {}), "min_replicas": 2},
    }
)


def test_the_scheduler_knows_a_peers_host_and_router_from_what_it_announces() -> None:
    def of(relayed: bool = False, **fields: str) -> tuple[str, str]:
        d = domains_of(cpb.PeerAnnouncement(peer="p", **fields), relayed)
        return d.host, d.router

    assert of(address="203.0.113.7:7700") == ("203.0.113.7", "203.0.113.7")  # direct
    assert of(address="203.0.113.7:7700", host_id="box-1a2b") == ("box-1a2b", "203.0.113.7")
    # Behind NAT: its LAN address says nothing; the relay saw its router's.
    assert of(True, address="192.168.1.10:7700") == ("", "")
    home = of(True, address="192.168.1.10:7700", host_id="box", public_address="198.51.100.4")
    assert home == ("box", "198.51.100.4")
    assert of(address="127.0.0.1:7700") == ("127.0.0.1", "")  # one machine: no router named
    assert of(address="[2001:db8::1]:7700")[1] == "2001:db8::1"


@pytest.mark.slow
@pytest.mark.timeout(180)
@AMQTT_LEAKS
async def test_a_stages_two_replicas_land_on_distinct_hosts_and_one_router_is_a_warning(
    tmp_path: Path,
) -> None:
    # Placed at once (the grace lets all four finish measuring: co-located peers measure one
    # at a time and agree exactly), the old placement put a, c on one stage and b, d on the other.
    async with scheduled_swarm(tmp_path, placement_grace_s=3.0) as swarm:
        job = swarm.store.create("test", SPEC, str(tmp_path), 100_000).id
        swarm.scheduler.submitted(job)
        hosts = {"a": "box1", "b": "box2", "c": "box1", "d": "box2"}
        for name, host in hosts.items():
            await swarm.add(name, host=host)
        registry = swarm.scheduler.peer_registry

        def served() -> list[list[str]]:
            return [[r.peer for r in stage] for stage in registry.members(job, 2)]

        await wait_until(
            lambda: [len(s) for s in served()] == [2, 2], "two replicas a stage", timeout_s=WAIT_S
        )
        stages = served()
        assert all(len({hosts[p] for p in stage}) == 2 for stage in stages), stages
        # Every peer here announces the loopback address: no router is named, so no warning.
        assert not any("router" in w or "machine" in w for w in swarm.status(job).warnings)
        # Home routers: each peer says the public address its relay saw (all one router).
        for peer in swarm.peers.values():
            peer.agent.announcement = _seen_from(peer.agent.announcement, "203.0.113.7")  # type: ignore[method-assign]
            await peer.agent.announce()
        texts = [
            f"stage {k}'s replicas ({', '.join(s)}) all sit behind one router (203.0.113.7)"
            for k, s in enumerate(stages)
        ]
        await wait_until(
            lambda: all(any(t in w for w in swarm.status(job).warnings) for t in texts),
            "a warning for each stage behind the one router",
            timeout_s=WAIT_S,
        )
        assert "one outage stops it" in swarm.status(job).warnings[-1]


def _seen_from(
    announcement: Callable[[], cpb.PeerAnnouncement], public: str
) -> Callable[[], cpb.PeerAnnouncement]:
    """`announcement` with `public_address` set, as a peer's whose relay saw it come from there."""

    def said() -> cpb.PeerAnnouncement:
        message = announcement()
        message.public_address = public
        return message

    return said
