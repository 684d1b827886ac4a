"""A peer flipping its announcement (N9): 500 times serving a running job's stage, then not, as
fast as a raw MQTT client can send them. A peer the scheduler never put on the job writes nothing
into its history; one it did (it gave it a stage) writes a bounded number of events, the job's
earlier events stay, and the scheduler's log gets a bounded number of lines."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from scheduler.coordinator.membership import JOIN_LOG_EVERY_S
from scheduler.coordinator.standbys import LOST_COOLDOWN_S
from scheduler.dial_scope import PACE_S
from scheduler.history import PEER_BURST, PEER_EVERY_S
from swarm.bus.topics import Topics
from swarm.proto import control_pb2 as cpb
from tests.support.raw_mqtt import RawClient, connect_packet, publish_packet
from tests.support.scheduled import AMQTT_LEAKS, LONG_SPEC, WAIT_S, ScheduledSwarm, scheduled_swarm
from tests.support.waiting import wait_until

pytestmark = [
    pytest.mark.attack("N9"),
    pytest.mark.slow,
    pytest.mark.timeout(240),
    AMQTT_LEAKS,
]

FLIPS = 500


async def _flip(swarm: ScheduledSwarm, peer: str, job: str) -> None:
    """`peer` (its own MQTT user) says it serves `job`'s stage 0, then that it waits, `FLIPS`
    times; returns once the scheduler has seen the last announcement."""
    topic = Topics().peer(peer)
    serving = cpb.PeerAnnouncement(
        peer=peer, address="127.0.0.1:9", job=job, stage=0, state=cpb.PEER_STATE_SERVING
    )
    waiting = cpb.PeerAnnouncement(peer=peer, job=job, state=cpb.PEER_STATE_JOINING)
    last = cpb.PeerAnnouncement(peer=peer, device="done", state=cpb.PEER_STATE_JOINING)
    async with await RawClient.open("127.0.0.1", swarm.broker.port) as raw:
        await raw.send(connect_packet(f"peer-{peer}", username=peer))
        assert await raw.connack(WAIT_S) == 0
        for _ in range(FLIPS):
            await raw.send(publish_packet(topic, serving.SerializeToString(), retain=True))
            await raw.send(publish_packet(topic, waiting.SerializeToString(), retain=True))
        await raw.send(publish_packet(topic, last.SerializeToString(), retain=True))
        registry = swarm.scheduler.peer_registry

        def seen() -> bool:
            announced = registry.peers.get(peer)
            return announced is not None and announced.device == "done"

        await wait_until(seen, f"the scheduler saw {peer}'s last announcement", timeout_s=120)


def _said(caplog: pytest.LogCaptureFixture, peer: str) -> list[str]:
    """The scheduler's log lines that name `peer`."""
    lines = (r.getMessage() for r in caplog.records if r.name.startswith("scheduler"))
    return [line for line in lines if f" {peer} " in f" {line} "]


async def test_a_flipping_peer_neither_forges_a_jobs_history_nor_floods_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with scheduled_swarm(tmp_path) as swarm:
        job = await swarm.start_job(LONG_SPEC, tmp_path)
        before = [(e.kind, e.text) for e in swarm.store.events(job)]
        assert any(kind == "join" for kind, _ in before), before

        # m was never given a stage of the job: what it says of the job is not its history.
        caplog.clear()
        await _flip(swarm, "m", job)
        events = [(e.kind, e.text) for e in swarm.store.events(job)]
        assert not [text for _, text in events if text.startswith("m ")], events
        assert events[: len(before)] == before  # nothing replaced
        assert len(_said(caplog, "m")) <= 2, _said(caplog, "m")[:10]

        # v was placed on the job by the scheduler (given a stage, and killed): its flips count,
        # a bounded number of them.
        registry = swarm.scheduler.peer_registry
        await swarm.add("v")
        await wait_until(lambda: registry.given(job, "v") is not None, "v placed", timeout_s=WAIT_S)
        await swarm.kill("v")
        await wait_until(lambda: "v" not in registry.peers, "v gone", timeout_s=WAIT_S)
        before = [(e.kind, e.text) for e in swarm.store.events(job)]
        caplog.clear()
        started = time.monotonic()
        await _flip(swarm, "v", job)
        events = [(e.kind, e.text) for e in swarm.store.events(job)]
        said = _said(caplog, "v")
        took = time.monotonic() - started
        of_v = [text for _, text in events[len(before) :] if text.startswith("v ")]
        assert 1 <= len(of_v) <= PEER_BURST + 2, of_v
        assert events[: len(before)] == before
        # The log: the job's history lines of v (its quota, PEER_BURST, refilled one per
        # PEER_EVERY_S, and a line per PEER_EVERY_S that says the rest are not recorded); and
        # the coordinator's lines of v, each kind rated (its failed joins, absent or refused, one
        # per JOIN_LOG_EVERY_S each; its standing by, and its loss as a standby, one per
        # LOST_COOLDOWN_S). So as many as the flips' time allows, never one per flip. (A fixed
        # total was one line short when a loaded machine made the flips slow.)
        history = [line for line in said if line.startswith(f"job {job}: ")]
        assert len(history) <= PEER_BURST + 2 * (1 + took // PEER_EVERY_S) - 1, (took, history)
        # The dial-backs' verdicts on v's address (no one listens there): a check per PACE_S at
        # most, a verdict said once until it changes. (Counted with the others, they made one
        # line too many where the flips took long enough for the first dial to fail.)
        checks = [line for line in said if line.startswith("peer v ")]
        assert len(checks) <= 1 + took // PACE_S, (took, checks)
        others = [line for line in said if line not in history and line not in checks]
        rated = 2 * (1 + took // LOST_COOLDOWN_S) + 2 * (1 + took // JOIN_LOG_EVERY_S)
        assert len(others) <= rated, (took, others)
