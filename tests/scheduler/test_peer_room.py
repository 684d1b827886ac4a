"""The scheduler keeps at most `MAX_PEERS` peers (`scheduler.peer_room`).

A token holder may log in under any number of made-up ids, announce each (not retained) and
disconnect cleanly, so that no last-will says it left: every one stayed in the registry, the
dial-back checker's maps and the scheduler's retained reachability reports for good. Past the
bound, the peer heard from least recently that nobody can dial and the scheduler never placed
makes room for a newcomer; with no such peer the newcomer is turned away, said at WARNING."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from scheduler import peer_room
from scheduler.peer_room import PeerRoom
from scheduler.registry import PeerRegistry
from scheduler.service import Scheduler, SchedulerOptions
from scheduler.store import JobStore
from swarm.clock import FakeClock
from swarm.proto import control_pb2 as cpb
from tests.support.fakes import SilentBus
from tests.support.waiting import wait_until

CAP = 3


def _registry() -> PeerRegistry:
    return PeerRegistry(FakeClock(), load_silence_s=10.0, serve_timeout_s=300.0)


def _joining(peer: str) -> cpb.PeerAnnouncement:
    return cpb.PeerAnnouncement(peer=peer, address=f"{peer}.lan:5000", state=cpb.PEER_STATE_JOINING)


def _found(registry: PeerRegistry, peer: str, reachability: int) -> None:
    registry.reached(cpb.ReachabilityReport(peer=peer, reachability=reachability))  # type: ignore[arg-type]


def _admitted(room: PeerRoom, registry: PeerRegistry, message: cpb.PeerAnnouncement) -> list[str]:
    """What the scheduler's watch does: make room, forget those that made it, then keep it."""
    gone = room.admit(message)
    if gone is None:
        return ["(turned away)"]
    for peer in gone:
        registry.forget(peer)
    registry.announce(message)
    return gone


def test_past_the_bound_an_unreachable_peer_never_placed_makes_room() -> None:
    registry = _registry()
    room = PeerRoom(registry, cap=CAP)
    for peer in ("a", "b", "c"):
        assert _admitted(room, registry, _joining(peer)) == []
    _found(registry, "a", cpb.REACHABILITY_DIRECT)
    _found(registry, "b", cpb.REACHABILITY_UNREACHABLE)
    _found(registry, "c", cpb.REACHABILITY_UNREACHABLE)
    assert _admitted(room, registry, _joining("a")) == []  # heard again: not new, no room made
    assert _admitted(room, registry, _joining("d")) == ["b"]  # the least recently heard of b, c
    assert set(registry.peers) == {"a", "c", "d"}
    assert _admitted(room, registry, _joining("e")) == ["c"]
    assert set(registry.peers) == {"a", "d", "e"}


def test_a_placed_peer_a_relay_in_use_and_a_reached_one_never_make_room(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="scheduler.peer_room")
    registry = _registry()
    room = PeerRoom(registry, cap=CAP)
    _admitted(room, registry, _joining("a"))
    _found(registry, "a", cpb.REACHABILITY_UNREACHABLE)  # given a stage before it was checked
    registry.assigned("a", "j", 0)
    relay = cpb.PeerAnnouncement(peer="r", role=cpb.PEER_ROLE_RELAY, state=cpb.PEER_STATE_SERVING)
    relay.relay_address = "203.0.113.5:7100"  # nothing to dial, but a's calls go through it
    _admitted(room, registry, relay)
    behind = _joining("a")
    behind.relay = relay.relay_address  # a peer announces its relay by its listener's address
    # (by the relay's id, as this test had it, a relay in use was evicted first: no peer's
    # announcement names a relay by its id); the dial-back reached it there
    _admitted(room, registry, behind)
    relayed = cpb.REACHABILITY_RELAYED
    registry.reached(cpb.ReachabilityReport(peer="a", reachability=relayed, relay=behind.relay))
    _admitted(room, registry, _joining("b"))
    _found(registry, "b", cpb.REACHABILITY_DIRECT)  # reached: an honest peer waiting for work
    for newcomer in ("x", "y"):
        assert _admitted(room, registry, _joining(newcomer)) == ["(turned away)"]
    assert set(registry.peers) == {"a", "r", "b"}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "turned away" in lines[0] and f"at most {CAP}" in lines[0], lines


def test_a_peers_word_keeps_no_place() -> None:
    """Made-up peers that announce they serve, or give no address to dial, were never found
    unreachable, nor counted as not placed: 16,384 of them locked every newcomer out for good."""
    registry = _registry()
    room = PeerRoom(registry, cap=CAP)
    serving = cpb.PeerAnnouncement(peer="s", address="s:1", state=cpb.PEER_STATE_SERVING, job="j")
    no_address = cpb.PeerAnnouncement(peer="n", state=cpb.PEER_STATE_JOINING)
    for message in (serving, no_address, _joining("c")):
        _admitted(room, registry, message)
    _found(registry, "s", cpb.REACHABILITY_UNREACHABLE)
    _found(registry, "c", cpb.REACHABILITY_DIRECT)
    assert _admitted(room, registry, _joining("d")) == ["s"]
    assert _admitted(room, registry, _joining("e")) == ["n"]


def test_with_none_found_unreachable_the_oldest_not_checked_makes_room() -> None:
    """A flood of made-up ids comes faster than their checks: each newcomer takes the place of
    the oldest not checked yet, so an honest newcomer is checked (and kept) before the flood
    reaches it."""
    registry = _registry()
    room = PeerRoom(registry, cap=CAP)
    for peer in ("a", "b", "c"):
        _admitted(room, registry, _joining(peer))
    _found(registry, "a", cpb.REACHABILITY_DIRECT)
    assert _admitted(room, registry, _joining("honest")) == ["b"]
    _found(registry, "honest", cpb.REACHABILITY_DIRECT)
    assert _admitted(room, registry, _joining("made-up")) == ["c"]
    assert _admitted(room, registry, _joining("made-up-2")) == ["made-up"]
    assert {"a", "honest"} <= set(registry.peers)


def test_a_full_room_is_not_looked_over_again_for_each_newcomer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every place kept: each newcomer of a flood looked at all of them (16,384) on the event
    loop. A round that found none turns newcomers away for a second without another."""
    clock = FakeClock()
    registry = PeerRegistry(clock, load_silence_s=10.0, serve_timeout_s=300.0)
    room = PeerRoom(registry, cap=100)
    for i in range(100):
        _admitted(room, registry, _joining(f"p{i}"))
        _found(registry, f"p{i}", cpb.REACHABILITY_DIRECT)
    looked = [0]
    kind = peer_room._kind

    def counted(*args: object) -> str:
        looked[0] += 1
        return kind(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(peer_room, "_kind", counted)
    for i in range(50):
        assert _admitted(room, registry, _joining(f"new{i}")) == ["(turned away)"]
    assert looked[0] == 100  # one round, not 50
    clock.advance(2.0)
    assert _admitted(room, registry, _joining("later")) == ["(turned away)"]
    assert looked[0] == 200


def test_a_peer_that_left_frees_its_place() -> None:
    registry = _registry()
    room = PeerRoom(registry, cap=CAP)
    for peer in ("a", "b", "c"):
        _admitted(room, registry, _joining(peer))
    offline = cpb.PeerAnnouncement(peer="b", state=cpb.PEER_STATE_OFFLINE)
    assert _admitted(room, registry, offline) == []
    assert _admitted(room, registry, _joining("d")) == []
    assert set(registry.peers) == {"a", "c", "d"}


def test_made_up_peers_stay_within_the_bound() -> None:
    """50,000 made-up ids, each found unreachable once checked (their addresses are made up):
    the registry holds at most the bound, the honest peer among them stays."""
    registry = _registry()
    room = PeerRoom(registry, cap=1000)
    _admitted(room, registry, _joining("honest"))
    _found(registry, "honest", cpb.REACHABILITY_DIRECT)
    for i in range(50_000):
        peer = f"made-up-{i}"
        _admitted(room, registry, _joining(peer))
        _found(registry, peer, cpb.REACHABILITY_UNREACHABLE)
    assert len(registry.peers) <= 1000 and "honest" in registry.peers
    assert len(room) <= 1000


# -- the scheduler's watch of announcements -----------------------------------------------------


class _Bus(SilentBus):
    """Takes publications and keeps them; its subscription to announcements delivers `said`."""

    def __init__(self, *said: cpb.PeerAnnouncement) -> None:
        self.said = list(said)
        self.published: list[tuple[str, object]] = []

    async def publish(self, topic: str, message: object, retain: bool = False) -> None:
        self.published.append((topic, message))

    async def subscribe(self, pattern: str) -> AsyncIterator[tuple[str, object]]:
        for message in self.said if pattern == self.topics.peer("+") else []:
            yield self.topics.peer(message.peer), message
        await asyncio.Event().wait()


async def test_a_peer_that_makes_room_is_forgotten_as_if_it_left(tmp_path: Path) -> None:
    bus = _Bus()
    with JobStore(tmp_path / "jobs.sqlite") as store:
        scheduler = Scheduler(store, bus, SchedulerOptions(tmp_path / "ckpt"))  # type: ignore[arg-type]
        scheduler.peer_room.cap = 2
        for peer in ("a", "b"):
            scheduler._announced(_joining(peer))
        _found(scheduler.peer_registry, "b", cpb.REACHABILITY_UNREACHABLE)
        scheduler._announced(_joining("c"))
        assert set(scheduler.peer_registry.peers) == {"a", "c"}
        assert "b" not in scheduler.reachability._targets  # no more dial-backs of it
        # and its retained dial-back report is cleared
        await wait_until(lambda: (bus.topics.reachability("b"), b"") in bus.published)


async def test_a_peer_turned_away_takes_the_next_place_that_frees(tmp_path: Path) -> None:
    """Its announcement is not sent again (retained on the broker, read as the scheduler
    subscribes): turned away and forgotten, it waited for work that never came."""
    with JobStore(tmp_path / "jobs.sqlite") as store:
        scheduler = Scheduler(store, _Bus(), SchedulerOptions(tmp_path / "ckpt"))  # type: ignore[arg-type]
        scheduler.peer_room.cap = 1
        scheduler._announced(_joining("a"))
        _found(scheduler.peer_registry, "a", cpb.REACHABILITY_DIRECT)
        scheduler._announced(_joining("b"))  # no place: turned away
        assert set(scheduler.peer_registry.peers) == {"a"}
        scheduler._announced(cpb.PeerAnnouncement(peer="a", state=cpb.PEER_STATE_OFFLINE))
        assert set(scheduler.peer_registry.peers) == {"b"}
        assert "b" in scheduler.reachability._targets  # and it is checked


async def test_an_announcement_that_fails_unforeseen_is_said_and_the_next_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The watch of announcements runs in the scheduler's task group: an exception out of one
    message ended the scheduler."""
    bus = _Bus(_joining("bad"), _joining("good"))
    with JobStore(tmp_path / "jobs.sqlite") as store:
        scheduler = Scheduler(store, bus, SchedulerOptions(tmp_path / "ckpt"))  # type: ignore[arg-type]
        announce = scheduler.peer_registry.announce

        def fails_on_bad(message: cpb.PeerAnnouncement) -> None:
            if message.peer == "bad":
                raise RuntimeError("unforeseen")
            announce(message)

        monkeypatch.setattr(scheduler.peer_registry, "announce", fails_on_bad)
        watch = asyncio.create_task(scheduler._watch_peers())
        try:
            await wait_until(lambda: "good" in scheduler.peer_registry.peers or watch.done())
            assert not watch.done()
        finally:
            watch.cancel()
        assert any("peer 'bad' was not taken" in r.getMessage() for r in caplog.records)


def test_a_relay_is_kept_by_the_dial_backs_finding_not_a_peers_word() -> None:
    """Made-up ids each announcing a relay (`relay`) and being one (`relay_address`) of one
    address: each was kept by its own word, and a flood of them locked every newcomer out. A
    relay is kept where the dial-back reached a peer through it, one place an address."""
    registry = _registry()
    room = PeerRoom(registry, cap=CAP)
    for k in range(CAP):
        fake = cpb.PeerAnnouncement(peer=f"f{k}", state=cpb.PEER_STATE_JOINING)
        fake.relay = fake.relay_address = "203.0.113.9:7100"
        _admitted(room, registry, fake)
    assert _admitted(room, registry, _joining("d")) == ["f0"]
    # the dial-back reached d through that address: its first announcer left, f1, is kept
    relayed = cpb.REACHABILITY_RELAYED
    report = cpb.ReachabilityReport(peer="d", reachability=relayed, relay="203.0.113.9:7100")
    registry.reached(report)
    registry.clock.advance(1.0)  # the relays in use, as found, stand a second
    assert _admitted(room, registry, _joining("e")) == ["f2"]  # one place an address
    assert "f1" in registry.peers


def test_the_relays_in_use_are_found_once_a_second_not_for_each_newcomer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Finding them is a pass over every peer: for each newcomer of a flood into a full room
    (16,384 places), it held the event loop again (a review found it)."""
    passes: list[int] = []
    real = peer_room.relays_in_use
    monkeypatch.setattr(peer_room, "relays_in_use", lambda r: passes.append(1) or real(r))
    registry = _registry()
    room = PeerRoom(registry, cap=CAP)
    for k in range(CAP + 50):
        _admitted(room, registry, _joining(f"n{k}"))
    assert len(passes) == 1
    registry.clock.advance(1.0)
    _admitted(room, registry, _joining("late"))
    assert len(passes) == 2
