"""Boundary disputes on the push plane (`client.audit.disputes`): one disagreement names
nobody; a replica in dispute with two replicas of the same neighbouring stage is the liar, and an
honest replica framed from both sides (two liars of two stages) is not."""

from __future__ import annotations

from client.audit.disputes import HOLD, Dispute, Disputes


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


def test_the_receiver_is_set_aside_so_the_sender_must_deal_with_another() -> None:
    d = Disputes()
    d.add(_d("s1r0", 1, "s2r0", 2))  # activations: s1r0 sent, s2r0 received
    assert d.set_aside() == {"s2r0"}
    d.add(Dispute("s1r1", 1, "s2r2", 2, "input gradient", 3, 1))  # s2r2 sent, s1r1 received
    assert d.set_aside() == {"s2r0", "s1r1"}
    d.add(_d("s0r0", 0, "s1r2", 1))
    assert "s1r2" in d.set_aside()
    d.add(Dispute("s0r1", 0, "s1r0", 1, "input gradient", 3, 2))
    assert "s0r1" not in d.set_aside()  # stage 0: the trainer's own pick, never routed
    for _ in range(HOLD):
        d.set_aside()
    assert d.set_aside() == set()  # each held for HOLD microbatches only
