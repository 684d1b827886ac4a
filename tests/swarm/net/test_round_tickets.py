"""A round ticket (`swarm.net.round_tickets`) places one member at one place of one round, for
the owner whose secret it carries, at the part the ticket names that owner's peer id for, within
its age: every field the scheduler signed is checked."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarm.errors import PermissionDenied
from swarm.net.round_tickets import MAX_AGE_S, RoundPass, RoundTickets, issue_round_ticket
from swarm.proto import pool_pb2

T0 = 1_800_000_000.0
KEY = Ed25519PrivateKey.generate()
PEERS = ("p0", "p1", "p2", "p3")  # the group's peer ids: part k is PEERS[k]'s


class _Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def _header(part: int = 2, **changed: object) -> pool_pb2.PoolReduceRequest:
    """Member 1's contribution to the owner of `part`, with its proof for that owner, and the
    header's fields `changed` from what the ticket signed."""
    ticket = issue_round_ticket(
        KEY, job="j", stage=3, round="9/0", sender=1, peers=PEERS, contributors=3, now=T0
    )
    fields: dict[str, object] = {
        "job": "j",
        "stage": 3,
        "round": "9/0",
        "sender": 1,
        "group_size": 4,
        "contributors": 3,
        "part": part,
    }
    header = pool_pb2.PoolReduceRequest(**(fields | changed))  # type: ignore[arg-type]
    header.proof.CopyFrom(RoundPass(ticket, PEERS).to(part))
    return header


def _owner(clock: _Clock | None = None, peer: str = "p2") -> RoundTickets:
    return RoundTickets(KEY.public_key().public_bytes_raw(), peer, clock or _Clock())


def test_a_members_proof_is_taken_by_its_owner() -> None:
    owner = _owner()
    owner.check(_header())
    owner.check(_header())  # a part's next slice: remembered


@pytest.mark.parametrize(
    "changed",
    [
        {"job": "k"},
        {"stage": 4},
        {"round": "9/1"},
        {"sender": 0},
        {"group_size": 5},
        {"contributors": 4},
    ],
    ids=["job", "stage", "round", "sender", "group-size", "contributors"],
)
def test_every_signed_field_binds(changed: dict[str, object]) -> None:
    header = _header(**changed)
    if "group_size" in changed:  # the digests then miscount: refused as malformed
        with pytest.raises(PermissionDenied, match="malformed"):
            _owner().check(header)
        return
    with pytest.raises(PermissionDenied, match="not the scheduler's"):
        _owner().check(header)


def test_the_peer_ids_are_signed() -> None:
    # A member cannot rename the group's owners in its proof: the scheduler signed them.
    renamed = _header()
    renamed.proof.peers[0] = "p9"
    with pytest.raises(PermissionDenied, match="not the scheduler's"):
        _owner().check(renamed)


def test_no_proof_a_malformed_one_and_anothers_secret_are_refused() -> None:
    owner = _owner()
    bare = _header()
    bare.ClearField("proof")
    with pytest.raises(PermissionDenied, match="without the scheduler's round ticket"):
        owner.check(bare)
    short = _header()
    short.proof.secret = b"x"
    with pytest.raises(PermissionDenied, match="malformed"):
        owner.check(short)
    long_id = _header()
    long_id.proof.peers[3] = "p" * 129
    with pytest.raises(PermissionDenied, match="malformed"):
        owner.check(long_id)
    few_ids = _header()
    del few_ids.proof.peers[3]
    with pytest.raises(PermissionDenied, match="malformed"):
        owner.check(few_ids)
    elsewhere = _header(part=2)
    elsewhere.part = 1  # the secret for owner 2, shown to owner 1 as part 1's
    with pytest.raises(PermissionDenied, match="not for the owner of part 1"):
        _owner(peer="p1").check(elsewhere)


def test_an_owner_takes_only_its_own_part() -> None:
    # Owner 2's secret of member 1, replayed by owner 2 to owner 1 as part 2: the digest
    # matches, and before the peer ids were signed owner 1 took it (and opened a slot for a
    # part no member sends it). The ticket names p2 for part 2, and this owner is p1.
    with pytest.raises(PermissionDenied, match="p1 does not own part 2"):
        _owner(peer="p1").check(_header(part=2))


def test_a_stale_ticket_is_refused_even_once_verified() -> None:
    clock = _Clock()
    owner = _owner(clock)
    owner.check(_header())
    clock.now = T0 + MAX_AGE_S + 1
    with pytest.raises(PermissionDenied, match="issued"):
        owner.check(_header())


def test_a_pass_names_only_its_owners() -> None:
    ticket = issue_round_ticket(
        KEY, job="j", stage=0, round="1/0", sender=0, peers=PEERS[:2], contributors=0, now=T0
    )
    with pytest.raises(ValueError, match="2 owners"):
        RoundPass(ticket, PEERS[:2]).to(2)
    assert RoundPass.of(None, PEERS[:2]) is None


def test_an_owner_named_by_its_address_takes_its_part() -> None:
    # An in-process swarm's peers are named by their addresses ("127.0.0.1:7000"): the owners
    # read a peer id's bound, not `--peer`'s characters (every round of such a pool was refused
    # as "a malformed round ticket" while they did: tests/stage_server/replica/
    # test_follow_tickets.py's joiner never joined).
    peers = ("127.0.0.1:7000", "127.0.0.1:7001")
    ticket = issue_round_ticket(
        KEY, job="j", stage=0, round="1/0", sender=0, peers=peers, contributors=0, now=T0
    )
    header = pool_pb2.PoolReduceRequest(job="j", stage=0, round="1/0", sender=0, group_size=2)
    header.part = 1
    header.proof.CopyFrom(RoundPass(ticket, peers).to(1))
    _owner(peer="127.0.0.1:7001").check(header)
