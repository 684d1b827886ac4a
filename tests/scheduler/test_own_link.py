"""The scheduler's own broker link down (`scheduler.own_link`): every load report stops at once,
and every replica of every stage was left out `load_silence_s` later: the job read "stage k lost
its last replica ... start a stage server" for each stage and training stopped, though the
replicas computed on. While the link is down nobody's silence counts; from its return each
peer's is timed anew."""

from __future__ import annotations

from scheduler.own_link import PEERS_BACK_S
from scheduler.registry import PeerRegistry
from swarm.clock import FakeClock
from tests.support.announcements import serving

SILENCE_S = 10.0


def _members(registry: PeerRegistry) -> list[list[str]]:
    return [[r.peer for r in stage] for stage in registry.members("j", 2)]


def test_silences_are_not_judged_while_the_schedulers_own_link_is_down() -> None:
    clock, up = FakeClock(), [True]
    registry = PeerRegistry(
        clock, load_silence_s=SILENCE_S, serve_timeout_s=60.0, link=lambda: up[0]
    )
    for peer, stage in (("a", 0), ("b", 1)):
        registry.announce(serving(peer, stage, speeds=[5.0, 5.0]))
    assert _members(registry) == [["a"], ["b"]]
    up[0] = False  # the broker restarted: no report reaches the scheduler
    _members(registry)
    clock.advance(5 * SILENCE_S)
    assert _members(registry) == [["a"], ["b"]], "nobody left out for the scheduler's outage"
    up[0] = True
    _members(registry)  # the link seen back
    clock.advance(PEERS_BACK_S + SILENCE_S / 2)
    assert _members(registry) == [["a"], ["b"]], "timed from when the peers can be back too"
    clock.advance(SILENCE_S)  # and still no report: a silence of its own
    assert _members(registry) == [[], []]


def test_a_peer_silent_while_the_link_is_up_is_left_out_as_before() -> None:
    clock = FakeClock()
    registry = PeerRegistry(clock, load_silence_s=SILENCE_S, serve_timeout_s=60.0)
    registry.announce(serving("a", 0, speeds=[5.0, 5.0]))
    clock.advance(SILENCE_S + 1)
    assert _members(registry) == [[], []]
