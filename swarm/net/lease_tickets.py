"""Only a lease's holder accumulates: a replica the scheduler placed adds a microbatch's gradient
to its step's sums only from a call carrying the scheduler's ticket for that microbatch at its
stage.

Any swarm-token holder may call a stage's data plane, and a replica keeps the first accumulation
of each `(step, index)` (a later one is a retry's, answered as a duplicate). Before, a call of
anyone's with `accumulate` and a microbatch id of its choosing was taken: its finite gradient
stood in the step in place of the honest microbatch's, and a NaN one failed another submitter's
job at PREPARE (`NonFiniteStep`).

So the coordinator signs each task it leases (`scheduler.coordinator.lease_signer`): for each
stage the task accumulates at, the scheduler's Ed25519 signature over the job, the step, the
microbatch's index, the rollback epoch it was leased in (`swarm.rpc.epoch`), the stage and the
run it is pushed as (`StagePushRequest.run`; 0 on the carry plane, where a call has none). The
lessee's accumulating call at a stage carries that stage's ticket alone (`MicrobatchId.ticket`);
a push carries those of the stages it accumulates at (`StagePushRequest.tickets`), and each
replica pushes on only those of the later stages (`swarm.rpc.epoch.push_tickets`). A replica
that knows the scheduler's key (`swarm.net.commit_auth`: the scheduler placed it) refuses an
accumulating `Backward`, `ForwardBackward` or push whose ticket is not the scheduler's for that
very microbatch at its own stage (PERMISSION_DENIED): a call before it takes the worker, a push
from its header, before any of its path's compute. On the push plane, where a stage accumulates
only in the push that did its forward, an accumulating `Backward` or `ForwardBackward` is
refused whatever it carries.

What a ticket can do is what its lease does at one stage: it names one microbatch of one step,
and a replica keeps one accumulation of it a step. It carries no time: the step bounds it (a
replica drops a step's sums once applied), and the epoch a rollback (work leased before it is
refused, `Sums.admit`). Who sees one: the lessee; on the relay plane, the one replica of each
stage that accumulates there (no Forward, and no audit's re-execution, carries one); on the push
plane, the replicas the push goes through before that stage, each of which already decides
what that stage receives (the push records and the contributions' audit are for that); none
after it. One signature a stage a task at the scheduler (about 60 µs, on its event loop: a
lease of 8 tasks over 4 stages, 2 ms); a replica verifies each microbatch once (about 0.1 ms,
`REMEMBERED` kept). A stage server that knows no scheduler key (`swarm
trainer --stage-servers`, whose owner coordinates it) takes an accumulation on the token alone,
as before.
"""

from __future__ import annotations

import struct
from collections import OrderedDict

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from swarm.errors import PermissionDenied

__all__ = ["TICKET_BYTES", "LeaseTickets", "issue_lease_ticket"]

_CONTEXT = b"swarm-lease/2\0"
_MICROBATCH = struct.Struct(">qqQIQ")  # step, index, epoch, stage, run
TICKET_BYTES = 64  # the signature alone: everything it signs the call says already
# Verified tickets a replica remembers: a microbatch's retry (its push's backward after its
# forward, a trainer's resend) is checked by lookup.
REMEMBERED = 4096


def _signed(job: str, step: int, index: int, epoch: int, stage: int, run: int) -> bytes:
    microbatch = _MICROBATCH.pack(step, index, epoch, stage, run)
    return b"".join((_CONTEXT, job.encode(), b"\0", microbatch))


def issue_lease_ticket(
    key: Ed25519PrivateKey, job: str, step: int, index: int, epoch: int, stage: int, run: int
) -> bytes:
    """The ticket of microbatch `(step, index)` of `job` at `stage`, leased in rollback epoch
    `epoch` to be pushed as run `run` (0: the carry plane's, or a push keeping no record)."""
    return key.sign(_signed(job, step, index, epoch, stage, run))


class LeaseTickets:
    """What a replica (`peer`) checks an accumulation's ticket against: `public`, the key its
    scheduler announced."""

    def __init__(self, public: bytes, peer: str) -> None:
        self.public, self.peer = public, peer
        self._key = Ed25519PublicKey.from_public_bytes(public)
        self._verified: OrderedDict[tuple[str, int, int, int, int, int, bytes], None] = (
            OrderedDict()
        )

    def check(
        self, job: str, step: int, index: int, epoch: int, stage: int, run: int, ticket: bytes
    ) -> None:
        """PermissionDenied unless `ticket` is the scheduler's for microbatch `(step, index)` of
        `job` at `stage`, leased in `epoch` as run `run`."""
        named = f", run {run:x}" if run else ""
        what = f"{self.peer}: microbatch ({step}, {index}) of epoch {epoch} at stage {stage}{named}"
        if not ticket:
            raise PermissionDenied(
                f"{what}: an accumulation came without the scheduler's lease ticket; only the "
                "trainer it leased the microbatch to, or a stage passing its push on, adds to "
                "the step (the swarm token is not enough)"
            )
        if len(ticket) != TICKET_BYTES:
            raise PermissionDenied(f"{what}: a malformed lease ticket ({len(ticket)} bytes)")
        seen = (job, step, index, epoch, stage, run, ticket)
        if seen in self._verified:
            self._verified.move_to_end(seen)
            return
        try:
            self._key.verify(ticket, _signed(job, step, index, epoch, stage, run))
        except InvalidSignature:
            raise PermissionDenied(
                f"{what}: the lease ticket is not the scheduler's for this microbatch at this "
                "stage of this job and epoch, pushed as this run; not accumulated"
            ) from None
        self._verified[seen] = None
        while len(self._verified) > REMEMBERED:
            self._verified.popitem(last=False)
