"""An ended job's retained announcement outlives a broker outage: the sweep clears it only once
the broker has held it `retain_s` (`scheduler.retained.clear_retained`). Before, a final
announcement published while the broker was away was kept in the bus's memory, then replaced
there by the sweep's clear `retain_s` later; the broker, back, got only the clear, and peers
never learned that the job had ended (they served it for good)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from scheduler import ended_announcements, retained
from scheduler.main import SchedulerOptions
from scheduler.retained import clear_retained
from scheduler.service import Scheduler
from scheduler.store import JobStore
from swarm.bus.broker import EmbeddedBroker
from swarm.bus.connection import Bus, BusSettings
from swarm.bus.topics import SCHEDULER_USER
from swarm.proto import control_pb2 as cpb
from tests.support.broker_link import BrokerLink
from tests.support.ports import free_port

pytestmark = pytest.mark.timeout(90)

# (a publish waits 0.5 s for a link, not 10: the outage outlasts it, as a real one would)
QUICK = BusSettings(
    keepalive_s=1, operation_timeout_s=1.0, reconnect_max_s=0.5, publish_timeout_s=0.5
)
WAIT_S = 20.0
RETAIN_S = 0.5


def _bus(url: str, name: str) -> Bus:
    return Bus(url, name, username=SCHEDULER_USER, registry=CollectorRegistry(), settings=QUICK)


async def _until(condition: Callable[[], bool], what: str) -> None:
    try:
        async with asyncio.timeout(WAIT_S):
            while not condition():
                await asyncio.sleep(0.05)
    except TimeoutError:
        pytest.fail(f"{what}: not within {WAIT_S:g} s")


async def test_an_end_announced_in_an_outage_reaches_the_broker_before_its_clear(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the sweep's search for assignments gives up on a broker away within 1 s, not 10
    monkeypatch.setattr(retained, "_SWEEP_TIMEOUT_S", 1.0)
    broker = EmbeddedBroker(port=0)
    await broker.start()
    link = BrokerLink(broker.port)
    states: list[int] = []
    forgotten = asyncio.Event()
    try:
        async with _bus(link.url, "scheduler") as bus, _bus(broker.url, "a-peer") as peer:
            await bus.wait_connected(WAIT_S)
            await peer.wait_connected(WAIT_S)
            topic = bus.topics.job("j1")

            async def watch() -> None:
                async for _, message in peer.subscribe(topic):
                    assert isinstance(message, cpb.JobAnnouncement)
                    states.append(message.state)

            watching = asyncio.create_task(watch())
            running = cpb.JobAnnouncement(job="j1", name="j1", state=cpb.JOB_STATE_RUNNING)
            await bus.publish(topic, running, retain=True)
            await _until(lambda: cpb.JOB_STATE_RUNNING in states, "running")
            link.cut()
            await _until(lambda: not bus.connected, "the scheduler's link down")
            ended = cpb.JobAnnouncement(job="j1", name="j1", state=cpb.JOB_STATE_CANCELLED)
            await bus.publish(topic, ended, retain=True, timeout=0.2)  # kept for the broker
            sweep = asyncio.create_task(
                clear_retained(bus, "j1", RETAIN_S, lambda _: forgotten.set())
            )
            await asyncio.sleep(3.0)  # the search and the job's retain_s pass while it is away
            link.mend()
            await _until(lambda: cpb.JOB_STATE_CANCELLED in states, "the end, on the broker")
            await asyncio.wait_for(sweep, WAIT_S)  # and then cleared, the job forgotten
            assert forgotten.is_set()
            watching.cancel()
    finally:
        link.close()
        await broker.stop()


async def test_a_broker_that_never_comes_back_holds_the_clear_a_bounded_while(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(retained, "_SWEEP_TIMEOUT_S", 0.5)
    forgotten: list[str] = []
    async with _bus(f"mqtt://127.0.0.1:{free_port()}", "scheduler") as bus:  # nothing there
        # cleared after 10 x retain_s (the job forgotten here), not waited for for good
        await asyncio.wait_for(clear_retained(bus, "j1", 0.2, forgotten.append), WAIT_S)
    assert forgotten == ["j1"]
    assert "job j1: the broker did not stay reachable" in caplog.text


async def test_an_old_ended_jobs_leftovers_are_swept_at_a_start(tmp_path: Path) -> None:
    """At a start only the newest 100 jobs' retained topics were swept: an older ended job whose
    sweep a stop cut short kept its announcement and assignments on the broker for good."""
    async with EmbeddedBroker() as broker:
        with JobStore(tmp_path / "jobs.sqlite") as store:
            old = store.create("old", "", str(tmp_path), 10).id
            store.set_state(old, "cancelled", message="cancelled on request")
            for i in range(101):  # newer ended jobs: the old one is past the first page
                store.set_state(store.create(f"new{i}", "", str(tmp_path), 10).id, "cancelled")
            async with _bus(broker.url, "scheduler") as bus:
                await bus.wait_connected(WAIT_S)
                left = bus.topics.assign(old, "peer-a")
                await bus.publish(left, b"\x08\x01", retain=True)  # its last assignment
                assert _held(broker, left)
                opts = SchedulerOptions(tmp_path / "ckpt", finished_retain_s=0.2)
                stop = asyncio.Event()
                running = asyncio.create_task(Scheduler(store, bus, opts).run(stop))
                try:
                    await _until(lambda: not _held(broker, left), "the old job's assignment swept")
                finally:
                    stop.set()
                    await asyncio.wait_for(running, WAIT_S)


def _held(broker: EmbeddedBroker, topic: str) -> bool:
    held = broker._broker.retained_messages.get(topic)  # type: ignore[union-attr]
    return held is not None and bool(held.data)


async def test_a_start_says_the_last_ended_jobs_announcements_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedded broker starts with the scheduler holding nothing: the ended jobs whose
    announcements stay (here the one that ended last, not the one made last) are said again,
    for a peer away across their end."""
    monkeypatch.setattr(ended_announcements, "KEPT", 1)
    async with EmbeddedBroker() as broker:
        with JobStore(tmp_path / "jobs.sqlite") as store:
            first, last = (store.create(n, "", str(tmp_path), 10).id for n in ("first", "last"))
            store.set_state(last, "cancelled")
            store.set_state(first, "cancelled")  # the one that ended last
            async with _bus(broker.url, "scheduler") as bus:
                await bus.wait_connected(WAIT_S)
                opts = SchedulerOptions(tmp_path / "ckpt", finished_retain_s=0.2)
                stop = asyncio.Event()
                running = asyncio.create_task(Scheduler(store, bus, opts).run(stop))
                try:
                    await _until(lambda: _held(broker, bus.topics.job(first)), "said again")
                    assert not _held(broker, bus.topics.job(last))
                finally:
                    stop.set()
                    await asyncio.wait_for(running, WAIT_S)
