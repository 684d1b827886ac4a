"""A stall whose missing piece is the relay (issue 51, item 2): the guide's single relay killed,
every stage's replicas were reached only through it, and the job's message named "start a stage
server" (which would be cut off the same way). The real registry and stall watch, wired as the
scheduler wires them: the message names the relay and what brings one back."""

from __future__ import annotations

import asyncio
from pathlib import Path

from scheduler.history import History
from scheduler.registry import PeerRegistry
from scheduler.stall_words import REMEDY
from scheduler.stalls import Health, StallWatch
from scheduler.store import JobState, JobStore
from swarm.clock import FakeClock
from swarm.proto import control_pb2 as cpb

RELAY, OTHER = "203.0.113.5:7100", "198.51.100.9:7100"
STAGES = 2


def _serving(
    name: str, stage: int, job: str, relay: str = "", public: str = ""
) -> cpb.PeerAnnouncement:
    message = cpb.PeerAnnouncement(
        peer=name,
        address=f"192.168.1.{10 + stage}:7700",
        job=job,
        state=cpb.PEER_STATE_SERVING,
        relay=relay,
        samples_per_second={stage: 1.0},
        public_address=public,
    )
    message.stage = stage
    return message


def _relay(name: str, address: str, state: int = cpb.PEER_STATE_JOINING) -> cpb.PeerAnnouncement:
    return cpb.PeerAnnouncement(
        peer=name,
        address=address,
        relay_address=address,
        role=cpb.PEER_ROLE_RELAY,
        state=state,  # type: ignore[arg-type]
    )


def _report(name: str, reachability: int, relay: str = "") -> cpb.ReachabilityReport:
    return cpb.ReachabilityReport(peer=name, reachability=reachability, relay=relay)  # type: ignore[arg-type]


def _watched(tmp_path: Path, store: JobStore) -> tuple[str, PeerRegistry, StallWatch, list[str]]:
    job = store.create("tiny", "spec", "/data", steps=800).id
    registry = PeerRegistry(FakeClock(), load_silence_s=1e9, serve_timeout_s=300.0)
    message = ["training"]

    async def say(text: str, state: JobState | None) -> None:
        message[0] = text

    watch = StallWatch(
        job,
        lambda: registry.members(job, STAGES),
        lambda: 40,
        lambda: 30,
        say,
        lambda: message[0],
        History(store),
        Health(),
        lost=lambda missing: registry.lost_relays(job, missing),
        domains=registry.domains,
    )
    return job, registry, watch, message


def test_stages_cut_off_by_their_relays_death_name_the_relay_not_a_stage_server(
    tmp_path: Path,
) -> None:
    with JobStore(tmp_path / "jobs.db") as store:
        job, registry, watch, message = _watched(tmp_path, store)
        registry.announce(_relay("vps-relay", RELAY))
        for stage in range(STAGES):
            name = f"home{stage}"
            registry.announce(_serving(name, stage, job, relay=RELAY))
            registry.reached(_report(name, cpb.REACHABILITY_RELAYED, RELAY))
        asyncio.run(watch.look())
        assert message == ["training"]

        # The relay is killed: its last-will; the peers find no other relay and announce none,
        # and the dial-back finds nothing reaches them.
        registry.announce(cpb.PeerAnnouncement(peer="vps-relay", state=cpb.PEER_STATE_OFFLINE))
        for stage in range(STAGES):
            name = f"home{stage}"
            registry.announce(_serving(name, stage, job))
            registry.reached(_report(name, cpb.REACHABILITY_UNREACHABLE))
        asyncio.run(watch.look())
        said = message[0]
        assert said.startswith("stalled at step 40: stages 0, 1 have no replica since "), said
        assert "stages 0, 1: the relay is down" in said or "the relay is down" in said, said
        assert f"relay {RELAY}, which is gone" in said, said
        assert "restart the relay" in said and "second relay" in said, said
        assert REMEDY not in said, said
        events = [e.text for e in store.events(job) if e.kind == "stall"]
        assert events and all(f"relay {RELAY}" in e for e in events), events


def test_a_stage_with_a_peer_not_cut_off_by_a_relay_still_wants_a_stage_server(
    tmp_path: Path,
) -> None:
    with JobStore(tmp_path / "jobs.db") as store:
        job, registry, watch, message = _watched(tmp_path, store)
        registry.announce(_relay("r2", OTHER))  # another relay lives: not lost
        registry.announce(_serving("home0", 0, job, relay=RELAY))
        registry.reached(_report("home0", cpb.REACHABILITY_UNREACHABLE))
        registry.announce(_serving("away1", 1, job, relay=OTHER))  # its relay is present
        registry.reached(_report("away1", cpb.REACHABILITY_UNREACHABLE))
        assert registry.lost_relays(job, [0, 1]) == {0: RELAY}
        asyncio.run(watch.look())
        said = message[0]
        assert (
            f"stage 0: the relay is down: its replicas were reached only through relay {RELAY}"
            in said
        )
        assert f"stage 1: {REMEDY}" in said, said


def test_a_home_outage_is_named_as_such_not_a_missing_server(tmp_path: Path) -> None:
    """Issue 68 item 3: both of a friend's peers sat behind one router, which was pulled; the
    relay lived. Status said "start a stage server for this job ...: every stage rolls back to
    step 30", though the failure-domain warning had named the router and nothing rolled back
    once they returned. Now it says what is known: behind which router, since when, and both
    ends (they come back: nothing lost; another server takes the stage: the rollback)."""
    home = "198.51.100.7"
    with JobStore(tmp_path / "jobs.db") as store:
        job, registry, watch, message = _watched(tmp_path, store)
        registry.announce(_relay("vps-relay", RELAY))  # the relay lives throughout
        for stage in range(STAGES):
            name = f"home{stage}"
            registry.announce(_serving(name, stage, job, relay=RELAY, public=home))
            registry.reached(_report(name, cpb.REACHABILITY_RELAYED, RELAY))
        asyncio.run(watch.look())
        assert message == ["training"]
        for stage in range(STAGES):  # the router is pulled: their last-wills
            registry.announce(
                cpb.PeerAnnouncement(peer=f"home{stage}", state=cpb.PEER_STATE_OFFLINE)
            )
        asyncio.run(watch.look())
        asyncio.run(watch.look())  # the outage, said again: the second look ended in KeyError
        said = message[0]
        assert REMEDY not in said, said
        assert said.startswith("stalled at step 40: stages 0, 1 have no replica since "), said
        assert (
            f"; their replicas (home0, home1) all sit behind router {home}, unreachable since "
        ) in said, said
        assert "if they come back, training goes on from step 40 and nothing is lost" in said
        instead = "if other stage servers take them instead, every stage rolls back to"
        assert said.endswith(f"{instead} step 30, the last checkpoint (10 step(s) trained again)")
        events = [e.text for e in store.events(job) if e.kind == "stall"]
        assert events and all(f"behind router {home}" in e for e in events), events
