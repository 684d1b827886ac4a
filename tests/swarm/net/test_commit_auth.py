"""The scheduler's signature on the commit protocol's calls (M9): what a replica takes and what it
refuses, field by field; and the key a scheduler keeps across restarts, its owner's only."""

from __future__ import annotations

import stat
import time
from pathlib import Path

import pytest

from swarm.net import commit_auth
from swarm.net.commit_auth import (
    MAX_AGE_S,
    SIGNATURE_KEY,
    CommitRefused,
    CommitVerifier,
    SchedulerKey,
)
from swarm.proto import stage_pb2 as pb

pytestmark = pytest.mark.attack("M9")

KEY = SchedulerKey.generate()


def _commit(**fields: object) -> pb.StageCommitRequest:
    base: dict[str, object] = {
        "job": "j",
        "stage": 1,
        "step": 7,
        "phase": pb.COMMIT_PHASE_PREPARE,
        "group": ["10.0.0.1:5", "10.0.0.2:5"],
        "group_index": 0,
        "round": "r1",
        "microbatches": [0, 1],
        "total_samples": 8,
    }
    return pb.StageCommitRequest(**(base | fields))  # type: ignore[arg-type]


def _code(verifier: CommitVerifier, method: str, request: object, metadata: object) -> str:
    try:
        verifier.check(method, request, metadata)  # type: ignore[arg-type]
    except CommitRefused as e:
        return e.code.name
    return "OK"


def test_the_schedulers_call_is_taken_once() -> None:
    verifier = CommitVerifier(KEY.public, "a")
    request = _commit()
    signed = KEY.signer("a").metadata("Commit", request)
    assert _code(verifier, "Commit", request, signed) == "OK"
    assert _code(verifier, "Commit", request, signed) == "PERMISSION_DENIED"  # a replay
    assert _code(verifier, "Commit", request, KEY.signer("a").metadata("Commit", request)) == "OK"


def test_every_field_and_the_replica_and_the_method_are_bound() -> None:
    verifier = CommitVerifier(KEY.public, "a")
    request = _commit()
    changed = [
        _commit(group=["10.0.0.1:5", "6.6.6.6:5"]),  # Commit.group
        _commit(group_index=1),
        _commit(group_peers=["p1", "p2"]),  # the peer ids its round ticket names
        _commit(step=8),
        _commit(phase=pb.COMMIT_PHASE_APPLY),
        _commit(microbatches=[0]),
        _commit(grad_scale=1000.0),
        _commit(job="k"),
    ]
    for other in changed:
        signed = KEY.signer("a").metadata("Commit", request)
        assert _code(verifier, "Commit", other, signed) == "PERMISSION_DENIED", other
    join = pb.StageJoinRequest(job="j", stage=1, source="10.0.0.1:5", step=7)
    signed = KEY.signer("a").metadata("Join", join)
    evil = pb.StageJoinRequest(job="j", stage=1, source="6.6.6.6:5", step=7)  # Join.source
    assert _code(verifier, "Join", evil, signed) == "PERMISSION_DENIED"
    # Join.epoch: a far-off one would have the joiner refuse all honest work (`swarm.rpc.epoch`)
    far = pb.StageJoinRequest(job="j", stage=1, source="10.0.0.1:5", step=7, epoch=2**62)
    assert _code(verifier, "Join", far, signed) == "PERMISSION_DENIED"
    discard = pb.StageDiscardRequest(job="j", stage=1, step=7)
    assert _code(verifier, "Discard", discard, signed) == "PERMISSION_DENIED"  # another method
    for_b = KEY.signer("b").metadata("Join", join)  # signed for another replica
    assert _code(verifier, "Join", join, for_b) == "PERMISSION_DENIED"
    assert _code(verifier, "Join", join, signed) == "OK"


def test_a_round_ticket_names_each_members_peer_id() -> None:
    # Part k's owner takes a ticket's parts only as peer k (`swarm.net.round_tickets`): a round
    # with others is not ticketed without its members' peer ids, one each.
    signer = KEY.signer("a")
    ticketed = signer.with_round_ticket(_commit(group_peers=["p1", "p2"]))
    assert len(ticketed.round_ticket.secrets) == 2
    with pytest.raises(ValueError, match="0 peer ids for a group of 2"):
        signer.with_round_ticket(_commit())
    alone = _commit(group=["10.0.0.1:5"])
    assert not signer.with_round_ticket(alone).HasField("round_ticket")


def test_unsigned_forged_malformed_and_stale_calls_are_refused() -> None:
    now = [1_000_000.0]
    verifier = CommitVerifier(KEY.public, "a", clock=lambda: now[0])
    request = _commit()
    assert _code(verifier, "Commit", request, None) == "UNAUTHENTICATED"
    assert _code(verifier, "Commit", request, [("authorization", "Bearer t")]) == "UNAUTHENTICATED"
    forged = SchedulerKey.generate().signer("a").metadata("Commit", request)
    assert _code(verifier, "Commit", request, forged) == "PERMISSION_DENIED"
    assert _code(verifier, "Commit", request, [(SIGNATURE_KEY, b"x" * 10)]) == "PERMISSION_DENIED"
    signed = KEY.signer("a").metadata("Commit", request)  # signed at the real time: long ago
    assert _code(verifier, "Commit", request, signed) == "PERMISSION_DENIED"
    now[0] = time.time() + MAX_AGE_S / 2  # within the clocks' skew
    assert _code(verifier, "Commit", request, signed) == "OK"


def test_the_key_is_kept_and_private(tmp_path: Path) -> None:
    path = tmp_path / "ckpt" / "key"
    first = SchedulerKey.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = SchedulerKey.load_or_create(path)
    assert again.public == first.public and len(first.public) == 32
    path.write_bytes(b"not a key")
    with pytest.raises(ValueError, match="not a scheduler key"):
        SchedulerKey.load_or_create(path)


@pytest.mark.attack("L-nonce")
def test_a_call_signed_before_the_replica_started_is_refused() -> None:
    # Issue 54: a replica's memory of the nonces it took died with its process, so a signed
    # call seen on the wire (without TLS) was taken again by the restarted replica within
    # MAX_AGE_S. Now a call signed before the replica's process started is refused.
    request = _commit()
    signed = KEY.signer("a").metadata("Commit", request)
    assert _code(CommitVerifier(KEY.public, "a"), "Commit", request, signed) == "OK"
    started = time.time()  # the replica restarts
    restarted = CommitVerifier(KEY.public, "a", started=started)
    assert _code(restarted, "Commit", request, signed) == "PERMISSION_DENIED"
    while time.time() * 1000 <= int(started * 1000) + 1:
        pass  # (a millisecond on: the scheduler's next call is signed after the restart)
    fresh = KEY.signer("a").metadata("Commit", request)
    assert _code(restarted, "Commit", request, fresh) == "OK"


def test_a_published_key_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The key a run left in the repository (committed with 1cb5e785) is anyone's: a scheduler
    # that finds it in its checkpoint folder refuses to sign with it and says how to go on.
    path = tmp_path / "checkpoints" / "scheduler-commit-key"
    leaked = SchedulerKey.load_or_create(path)
    monkeypatch.setattr(commit_auth, "PUBLISHED", frozenset({leaked.public}))
    with pytest.raises(ValueError, match="published"):
        SchedulerKey.load_or_create(path)
    path.unlink()
    assert SchedulerKey.load_or_create(path).public != leaked.public
    assert len(commit_auth.PUBLISHED) == 1
