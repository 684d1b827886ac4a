"""Boundary disputes on the push plane (`client.data_plane.disputes`): one disagreement names
nobody; a replica in dispute with two replicas of the same neighbouring stage is the liar, and an
honest replica framed from both sides (two liars of two stages) is not."""

from __future__ import annotations

from client.data_plane.disputes import Dispute, Disputes


def _d(peer: str, stage: int, other: str, other_stage: int, index: int = 0) -> Dispute:
    return Dispute(peer, stage, other, other_stage, "activations", 3, index)


def test_one_word_against_one_names_nobody() -> None:
    d = Disputes()
    assert d.add(_d("s1r0", 1, "s2r0", 2)) == []
    assert d.add(_d("s1r0", 1, "s2r0", 2, index=1)) == []  # the same pair again


def test_a_liar_disputed_by_two_replicas_of_one_stage_is_named() -> None:
    d = Disputes()
    assert d.add(_d("s1r0", 1, "s2r0", 2)) == []
    (verdict,) = d.add(_d("s2r1", 2, "s1r0", 1, index=1))
    assert (verdict.peer, verdict.stage) == ("s1r0", 1)
    assert "s2r0 and s2r1" in verdict.evidence


def test_an_honest_replica_between_two_liars_of_two_stages_is_not_named() -> None:
    d = Disputes()
    assert d.add(_d("s0r0", 0, "s1r1", 1)) == []
    assert d.add(_d("s1r1", 1, "s2r0", 2)) == []
