"""A job's history as peers come and go: joins, moves, leaves with their cause, restarts; an
ended job's released peers are not said to have left."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler.history import PEER_BURST, PEER_EVERY_S, History, peer_events
from scheduler.store import JobStore
from swarm.proto import control_pb2 as cpb


def _serving(peer: str, job: str, stage: int) -> cpb.PeerAnnouncement:
    return cpb.PeerAnnouncement(
        peer=peer, job=job, stage=stage, state=cpb.PEER_STATE_SERVING, time=1.0
    )


def _offline(peer: str, time: float) -> cpb.PeerAnnouncement:
    return cpb.PeerAnnouncement(peer=peer, state=cpb.PEER_STATE_OFFLINE, time=time)


def test_peer_events_name_joins_moves_and_the_cause_of_a_leave() -> None:
    joining = cpb.PeerAnnouncement(peer="p", job="j", state=cpb.PEER_STATE_JOINING)
    assert peer_events(None, joining) == []
    assert peer_events(joining, _serving("p", "j", 1)) == [("j", "join", "p joined stage 1")]
    assert peer_events(_serving("p", "j", 1), _serving("p", "j", 1)) == []
    assert peer_events(_serving("p", "j", 1), _serving("p", "j", 0)) == [
        ("j", "move", "p moved from stage 1 to stage 0")
    ]
    # A last-will carries no time: the process died or was cut off. A clean stop says when.
    [(_, kind, text)] = peer_events(_serving("p", "j", 1), _offline("p", 0.0))
    assert kind == "leave" and "p left stage 1: its connection dropped (killed" in text
    [(_, _, text)] = peer_events(_serving("p", "j", 1), _offline("p", 5.0))
    assert text == "p left stage 1: it was stopped"
    assert peer_events(joining, _offline("p", 0.0)) == []  # it served nothing
    [(_, kind, text)] = peer_events(joining, _serving("p", "j", 1), back="restarted")
    assert kind == "restart" and text.startswith("p is back, restarted")


def test_a_peer_back_under_a_dead_ones_id_reads_as_a_restart(tmp_path: Path) -> None:
    with JobStore(tmp_path / "jobs.db") as store:
        job = store.create("tiny", "spec", "/data", steps=5).id
        history = History(store, vouched=lambda job, peer: True)
        serving = _serving("p", job, 1)
        history.peer(None, serving)
        history.peer(serving, _offline("p", 0.0))
        fresh = cpb.PeerAnnouncement(peer="p", job=job, state=cpb.PEER_STATE_JOINING)
        history.peer(None, fresh)
        history.peer(fresh, serving)
        history.peer(None, _serving("q", job, 0))  # another peer: a plain join
        assert [e.kind for e in store.events(job)] == ["join", "leave", "restart", "join"]
        store.set_state(job, "cancelled")
        history.peer(serving, cpb.PeerAnnouncement(peer="p", state=cpb.PEER_STATE_JOINING))
        assert len(store.events(job)) == 4  # released by the ended job: not a leave


def test_a_peer_back_as_the_same_process_reconnected_and_a_new_one_restarted(
    tmp_path: Path,
) -> None:
    # Issue 51: a home outage cut peers off the broker (their last-wills fired) and they came
    # back as the same processes; history said "restarted (a new process ...)". The incarnation
    # each announces (its last-will included) tells the two apart.
    with JobStore(tmp_path / "jobs.db") as store:
        job = store.create("tiny", "spec", "/data", steps=5).id
        history = History(store, vouched=lambda job, peer: True)
        first = _serving("p", job, 1)
        first.incarnation = "aaaa"
        history.peer(None, first)
        will = _offline("p", 0.0)
        will.incarnation = "aaaa"
        history.peer(first, will)
        history.peer(None, first)  # the same process, its link back
        [event] = store.events(job)[-1:]
        assert event.kind == "reconnect", event
        assert event.text.startswith("p is back, reconnected (the same process"), event.text
        assert "restarted" not in event.text
        history.peer(first, will)
        second = _serving("p", job, 1)
        second.incarnation = "bbbb"
        history.peer(None, second)  # a new process under the id
        [event] = store.events(job)[-1:]
        assert event.kind == "restart" and "restarted (a new process" in event.text
        # A peer of before, which announces none: neither is claimed.
        history.peer(second, _offline("p", 0.0))
        history.peer(None, _serving("p", job, 1))
        [event] = store.events(job)[-1:]
        assert "restarted or reconnected (it does not announce which)" in event.text


def test_a_move_reads_as_a_move_not_a_restart(tmp_path: Path) -> None:
    # What a peer moved by rebalancing announces: serving stage 1, draining it while it builds
    # stage 0, serving stage 0 (issue 45, item 5: this read as a leave and a restart).
    with JobStore(tmp_path / "jobs.sqlite") as store:
        job = store.create("tiny", "spec", "/data", steps=5).id
        history = History(store, vouched=lambda job, peer: True)
        serving = _serving("p", job, 1)
        draining = cpb.PeerAnnouncement(peer="p", job=job, stage=1, state=cpb.PEER_STATE_DRAINING)
        history.peer(None, serving)
        history.peer(serving, draining)
        history.peer(draining, _serving("p", job, 0))
        assert [(e.kind, e.text) for e in store.events(job)] == [
            ("join", "p joined stage 1"),
            ("move", "p moved from stage 1 to stage 0"),
        ]
        # A peer that dies while it moves left the stage it served.
        moving = cpb.PeerAnnouncement(peer="p", job=job, stage=0, state=cpb.PEER_STATE_DRAINING)
        [(_, kind, text)] = peer_events(moving, _offline("p", 0.0))
        assert kind == "leave" and text.startswith("p left stage 0: its connection dropped")


@pytest.mark.attack("N9")
def test_only_vouched_peers_count_and_each_within_its_quota(tmp_path: Path) -> None:
    now = [0.0]
    with JobStore(tmp_path / "jobs.sqlite") as store:
        job = store.create("tiny", "spec", "/data", steps=5).id
        history = History(store, vouched=lambda j, peer: peer == "p", clock=lambda: now[0])
        joining = cpb.PeerAnnouncement(peer="x", job=job, state=cpb.PEER_STATE_JOINING)
        for _ in range(100):  # x names the job; the scheduler never put it there
            history.peer(joining, _serving("x", job, 0))
            history.peer(_serving("x", job, 0), joining)
        assert store.events(job) == []
        history.admitted(job, 3, 0, "p", "q")  # admissions count against the peer's quota too
        joining = cpb.PeerAnnouncement(peer="p", job=job, state=cpb.PEER_STATE_JOINING)
        for _ in range(500):
            history.peer(joining, _serving("p", job, 0))
            history.peer(_serving("p", job, 0), joining)
        assert len(store.events(job)) == PEER_BURST
        now[0] += PEER_EVERY_S  # one more in a while, saying how many were left out
        history.peer(joining, _serving("p", job, 0))
        *_, last = store.events(job)
        assert len(store.events(job)) == PEER_BURST + 1
        assert last.text.endswith(
            f"({1000 - PEER_BURST + 1} earlier change(s) of p not recorded: too frequent)"
        )
