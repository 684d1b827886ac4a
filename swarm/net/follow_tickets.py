"""Only the coordinator names followers (issue 44, N7): a replica the scheduler placed keeps its
updates for a peer copying it only when the scheduler's ticket names that peer.

A follower holds a place of the source's `--max-followers` and a share of its update log for as
long as it asks for updates, and any token holder may call `DownloadState` and `Updates`: four
that named themselves followers and then asked for updates as a copy does would keep every real
joiner out for as long as they went on; one naming a real joiner could move or end that joiner's
registration. So the coordinator, which alone tells a replica to copy a source (its signed
`Join`), gives the joiner with it a ticket: the scheduler's Ed25519 signature over the job, the
stage, the follower (the joiner's peer id), the source (the copied replica's peer id) and when it
was issued. The joiner presents it with its `DownloadState` and `Updates`; the source, when it
knows the scheduler's key (`swarm.net.commit_auth`: it was placed by the scheduler), takes a
follower's name only with a ticket naming that follower and itself (PERMISSION_DENIED
otherwise), and registers a new follower only with a ticket issued within `MAX_AGE_S`. A ticket
is for one joiner and one source: seen by no one else, and all it can do is what its joiner does.
Asking for updates needs no fresh ticket: the registration it asks under is bounded by the update
log (`stage_server.replica.update_log`: silent followers go).

A download that names no follower (a checkpoint, an export, `swarm` tooling) needs no ticket: it
registers nothing, and `--max-state-downloads` bounds how many are served at once. A stage
server that knows no scheduler key (`swarm trainer --stage-servers`, whose owner coordinates it)
takes a follower's name on the token alone, as before.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from swarm.errors import PermissionDenied

__all__ = ["MAX_AGE_S", "FollowTickets", "issue_ticket"]

#: A ticket registers a follower this long after (or before: clocks differ) it was issued: the
#: clock skew a peer accepts of the scheduler, as a signed commit call's
#: (`swarm.net.commit_auth.MAX_AGE_S`). A joiner starts its download as the `Join` arrives.
MAX_AGE_S = 300.0

_CONTEXT = b"swarm-follow/1\0"
_HEAD = struct.Struct(">q")  # issued (ms)
_SIGNATURE_BYTES = 64
TICKET_BYTES = _HEAD.size + _SIGNATURE_BYTES


def _signed(job: str, stage: int, follower: str, source: str, head: bytes) -> bytes:
    return b"".join(
        (
            _CONTEXT,
            job.encode(),
            b"\0",
            struct.pack(">I", stage),
            follower.encode(),
            b"\0",
            source.encode(),
            b"\0",
            head,
        )
    )


def issue_ticket(
    key: Ed25519PrivateKey, job: str, stage: int, follower: str, source: str, now: float
) -> bytes:
    """The ticket naming `follower` a follower of `source` in `stage` of `job`, issued `now`."""
    head = _HEAD.pack(int(now * 1000))
    return head + key.sign(_signed(job, stage, follower, source, head))


class FollowTickets:
    """What a source replica (`peer`) checks a follower's ticket against: `public`, the key its
    scheduler announced."""

    def __init__(self, public: bytes, peer: str, clock: Callable[[], float] = time.time) -> None:
        self.public, self.peer, self.clock = public, peer, clock
        self._key = Ed25519PublicKey.from_public_bytes(public)

    def check(self, job: str, stage: int, follower: str, ticket: bytes, *, fresh: bool) -> None:
        """PermissionDenied unless `ticket` is the scheduler's, naming `follower` a follower of
        this replica in `stage` of `job` (and, `fresh`, issued within `MAX_AGE_S`: a new
        registration)."""
        if not ticket:
            raise PermissionDenied(
                f"{self.peer} keeps updates only for the followers its scheduler names: "
                f"{follower!r} came without the scheduler's ticket (the swarm token is not "
                "enough; a download that names no follower needs none)"
            )
        if len(ticket) != TICKET_BYTES:
            raise PermissionDenied(f"follower {follower!r}: a malformed ticket")
        head, signature = ticket[: _HEAD.size], ticket[_HEAD.size :]
        try:
            self._key.verify(signature, _signed(job, stage, follower, self.peer, head))
        except InvalidSignature:
            raise PermissionDenied(
                f"follower {follower!r}: the ticket is not the scheduler's naming it a follower "
                f"of {self.peer} in stage {stage} of this job"
            ) from None
        (issued_ms,) = _HEAD.unpack(head)
        age = self.clock() - issued_ms / 1000
        if fresh and abs(age) > MAX_AGE_S:
            raise PermissionDenied(
                f"follower {follower!r}: its ticket was issued {age:.0f} s from now (more than "
                f"{MAX_AGE_S:.0f} s): a stale one, or the scheduler's clock is wrong; the "
                "coordinator's next Join brings a new one"
            )
