"""Placement prices each replica's path (`path_speeds`): a relayed peer counts at a share of its
measured samples/s, so placement keeps relays off a stage they alone would bottleneck."""

from __future__ import annotations

import pytest

from swarm.policy.placement import RELAYED_FACTOR, bottleneck, path_speeds, place


def test_a_relayed_peer_counts_at_the_relay_factor_and_a_measured_share_replaces_it() -> None:
    speeds = {"a": [10.0, 4.0], "r": [12.0, 6.0], "m": [8.0, 8.0]}
    priced = path_speeds(speeds, {"r": None, "m": 0.75})
    assert priced["a"] == [10.0, 4.0]  # direct: as measured
    assert priced["r"] == [12.0 * RELAYED_FACTOR, 6.0 * RELAYED_FACTOR]
    assert priced["m"] == [6.0, 6.0]
    assert path_speeds(speeds, {"r": None}, factor=0.2)["r"] == pytest.approx([2.4, 1.2])
    with pytest.raises(ValueError, match="relay factor"):
        path_speeds(speeds, {}, factor=0.0)


def test_placement_keeps_a_relayed_peer_off_a_stage_it_alone_would_bottleneck() -> None:
    speeds = {"a": [10.0, 10.0], "b": [10.0, 10.0], "r": [12.0, 12.0]}
    # Measured alone, r is the fastest: it gets a stage to itself (12 vs 10 + 10).
    blind = place(speeds, 2)
    assert [p for p, k in blind.items() if k == blind["r"]] == ["r"]
    # Through its relay it does 6: a stage of its own would run at 6. It joins a direct peer.
    priced = path_speeds(speeds, {"r": None})
    placed = place(priced, 2)
    assert sorted(p for p, k in placed.items() if k == placed["r"]) in (["a", "r"], ["b", "r"])
    assert bottleneck(placed, priced, 2) == 10.0 > bottleneck(blind, priced, 2)
