"""bench/newcomer_home.py's verdict on canned runs: a missed milestone or hops through the relay
fail the newcomer path (the bench itself needs root and namespaces; CI's slow run is the bench's
own, not a test's)."""

from __future__ import annotations

from bench.newcomer_home import score

KEPT = {"scheduler ready": 8.6, "both serving": 27.4, "job finished": 31.5}


def test_a_path_that_kept_its_promise_passes() -> None:
    assert score(KEPT, {"lan": 6_352_610, "relay": 232_543}) == []


def test_a_second_machine_that_never_serves_fails_the_path() -> None:
    refused = KEPT | {"both serving": None, "job finished": None}
    failed = score(refused, {"lan": 0, "relay": 120_000})
    assert failed[:2] == ["both serving: never", "job finished: never"]
    assert "went through the relay" in failed[2]


def test_hops_through_the_relay_fail_a_path_that_finished() -> None:
    failed = score(KEPT, {"lan": 200_000, "relay": 6_000_000})
    assert failed == ["the hops between the machines went through the relay, not their LAN"]
