"""Only a round's members reduce: an owner takes a contribution as sender i only from the replica
the scheduler placed at i of that round.

An owner's `PoolService.Reduce` checked the job and stage of a contribution, not who sent it, and
round ids are predictable (`STEP/ATTEMPT` and the rollback epoch). Any token holder could then
send a part as any sender of any round, begun or not: plant the values an owner sums and reports
(its checksum report would read an honest member as the liar), abort rounds naming every other
sender (a call with a 50 ms deadline opens a slot and times out), or hold every one of an owner's
open rounds on made-up ids, so that each honest round is refused.

The coordinator, which alone sends PREPARE (signed: `swarm.net.commit_auth`), gives each member
with it a round ticket: the scheduler's Ed25519 signature over the job, the stage, the round,
the member's place in the group, the group's members' peer ids and contributors, when it was
issued, and the SHA-256 digests of one fresh secret for each owner, the secrets themselves given
to that member alone. A member's contribution to owner k carries the ticket, the peer ids, the
digests and its secret for k; the owner checks the signature with the scheduler's public key
(which it knows as every replica of a scheduled job does, and an aggregator from the job's
announcement), that part k is its own (the ticket's k-th peer id is its own), that the secret is
the one part k's digest names, and the ticket's age. An owner thus learns only the secrets meant
for it, and can use them nowhere: replayed to another owner, as that owner's part the digest
does not match, and as its own part the other owner is not that part's peer (before the peer ids
were signed, a hostile owner's replay opened a slot for its part at another owner, which on its
deadline aborted that owner's round naming the honest members). No one outside the group has a
ticket at all. One signature a member and a PREPARE (about 70 µs each at the
scheduler); an owner verifies a (round, sender) once (about 0.1 ms) and remembers it, so the
slices of a part cost a digest each.

An owner that knows no scheduler key (`swarm trainer --stage-servers`, whose owner coordinates
it) takes a contribution on the token alone, as before, as `swarm.net.follow_tickets` does.
"""

from __future__ import annotations

import hashlib
import os
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from swarm.errors import PermissionDenied
from swarm.net.peer_ids import MAX_PEER_ID_CHARS
from swarm.proto import pool_pb2
from swarm.proto import stage_pb2 as pb

__all__ = ["MAX_AGE_S", "RoundPass", "RoundTickets", "issue_round_ticket"]

#: A contribution is taken this long after (or before: clocks differ) its ticket was issued. Not
#: the commit calls' 300 s: a PREPARE may wait `commit_timeout_s` (unbounded) before its round
#: begins, and a round takes up to `averaging_timeout_s` more. What an old ticket can do is
#: little: its round's id is its own, an owner remembers the last 256 rounds' outcomes (a late
#: part is told), and an older one reopened only waits out its timeout.
MAX_AGE_S = 3600.0

_CONTEXT = b"swarm-round/1\0"
_HEAD = struct.Struct(">q")  # issued (ms)
_PLACE = struct.Struct(">IIII")  # stage, sender, group size, contributors
_SIGNATURE_BYTES = 64
_TICKET_BYTES = _HEAD.size + _SIGNATURE_BYTES
_SECRET_BYTES = 16
_DIGEST_BYTES = 32
# Verified (round, sender) tickets an owner remembers: a round's slices are checked by digest.
_REMEMBERED = 4096


@dataclass(frozen=True)
class _Place:
    """Where a ticket puts its member: what the scheduler signs, with the owners' digests."""

    job: str
    stage: int
    round: str
    sender: int
    peers: tuple[str, ...]  # the group's members' peer ids, in group order: part k is peer k's
    contributors: int  # the group's contributing members (= its size when all contribute)

    def signed(self, head: bytes, digests: Sequence[bytes]) -> bytes:
        place = _PLACE.pack(self.stage, self.sender, len(self.peers), self.contributors)
        parts = (_CONTEXT, self.job.encode(), b"\0", self.round.encode(), b"\0", place, head)
        peers = (p.encode() + b"\0" for p in self.peers)  # \0 ends each: no peer id holds one
        return b"".join((*parts, *peers, *digests))


def _digest(secret: bytes) -> bytes:
    return hashlib.sha256(secret).digest()


def issue_round_ticket(
    key: Ed25519PrivateKey,
    *,
    job: str,
    stage: int,
    round: str,
    sender: int,
    peers: Sequence[str],
    contributors: int,
    now: float,
) -> pb.RoundTicket:
    """The ticket placing `sender` in `round` of `stage` of `job` (a group of the members
    `peers`, by peer id, of which the first `contributors` contribute; 0: all), issued `now`,
    with its secrets."""
    place = _Place(job, stage, round, sender, tuple(peers), contributors or len(peers))
    secrets = [os.urandom(_SECRET_BYTES) for _ in peers]
    head = _HEAD.pack(int(now * 1000))
    signature = key.sign(place.signed(head, [_digest(s) for s in secrets]))
    return pb.RoundTicket(ticket=head + signature, secrets=secrets)


class RoundPass:
    """A member's side of its round ticket: the proof it sends each owner. `peers`: the
    group's peer ids its PREPARE named (`StageCommitRequest.group_peers`)."""

    def __init__(self, ticket: pb.RoundTicket, peers: Sequence[str]) -> None:
        self._ticket, self._secrets = ticket.ticket, list(ticket.secrets)
        self._digests = [_digest(s) for s in self._secrets]
        self._peers = list(peers)

    @classmethod
    def of(cls, ticket: pb.RoundTicket | None, peers: Sequence[str]) -> RoundPass | None:
        """None for a PREPARE without a ticket (a pool its owner coordinates)."""
        return cls(ticket, peers) if ticket is not None and ticket.ticket else None

    def to(self, owner: int) -> pool_pb2.MemberProof:
        """The proof for the owner of part `owner` (its place in the group)."""
        if not 0 <= owner < len(self._secrets):
            raise ValueError(f"the ticket names {len(self._secrets)} owners, not part {owner}")
        return pool_pb2.MemberProof(
            ticket=self._ticket,
            digests=self._digests,
            secret=self._secrets[owner],
            peers=self._peers,
        )


class RoundTickets:
    """What an owner checks a contribution's proof against: `public`, the key of the scheduler
    that placed the pool's replicas; `peer`, the owner's own peer id, which a part it takes must
    be signed to."""

    def __init__(self, public: bytes, peer: str, clock: Callable[[], float] = time.time) -> None:
        self.public, self.peer, self.clock = public, peer, clock
        self._key = Ed25519PublicKey.from_public_bytes(public)
        self._verified: OrderedDict[tuple[_Place, bytes, tuple[bytes, ...]], None] = OrderedDict()

    def check(self, header: pool_pb2.PoolReduceRequest) -> None:
        """PermissionDenied unless `header` (a Reduce's first message) carries the scheduler's
        ticket placing its caller at `sender` of its round and this owner at `part`, and this
        owner's secret of it."""
        who = f"sender {header.sender} of round {header.round!r} (stage {header.stage})"
        proof = header.proof
        if not proof.ticket:
            raise PermissionDenied(
                f"{self.peer} sums a round's parts only from its members: {who} came without the "
                "scheduler's round ticket (the swarm token is not enough)"
            )
        well_formed = (  # counted before any digest or id is read
            len(proof.ticket) == _TICKET_BYTES
            and len(proof.digests) == len(proof.peers) == header.group_size
            and len(proof.secret) == _SECRET_BYTES
            and all(len(d) == _DIGEST_BYTES for d in proof.digests)
            and all(0 < len(p) <= MAX_PEER_ID_CHARS and "\0" not in p for p in proof.peers)
        )
        if not well_formed:
            raise PermissionDenied(f"{who}: a malformed round ticket")
        digests, peers = tuple(proof.digests), tuple(proof.peers)
        if header.part >= len(digests) or peers[header.part] != self.peer:
            raise PermissionDenied(
                f"{who}: {self.peer} does not own part {header.part} of that round (its ticket "
                "names another peer, or none)"
            )
        if _digest(proof.secret) != digests[header.part]:
            raise PermissionDenied(f"{who}: its proof is not for the owner of part {header.part}")
        contributors = header.contributors or header.group_size
        place = _Place(header.job, header.stage, header.round, header.sender, peers, contributors)
        head = proof.ticket[: _HEAD.size]
        (issued_ms,) = _HEAD.unpack(head)
        age = self.clock() - issued_ms / 1000
        if abs(age) > MAX_AGE_S:
            raise PermissionDenied(
                f"{who}: its round ticket was issued {age:.0f} s from now (more than "
                f"{MAX_AGE_S:.0f} s): a stale one, or the scheduler's clock is wrong"
            )
        self._verify(place, proof.ticket, digests, who)

    def _verify(self, place: _Place, ticket: bytes, digests: tuple[bytes, ...], who: str) -> None:
        known = (place, ticket, digests)
        if known in self._verified:
            self._verified.move_to_end(known)
            return
        head, signature = ticket[: _HEAD.size], ticket[_HEAD.size :]
        try:
            self._key.verify(signature, place.signed(head, digests))
        except InvalidSignature:
            raise PermissionDenied(
                f"{who}: the round ticket is not the scheduler's placing its caller there"
            ) from None
        self._verified[known] = None
        while len(self._verified) > _REMEMBERED:
            self._verified.popitem(last=False)
