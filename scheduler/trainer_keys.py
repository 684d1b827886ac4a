"""A trainer id is its first caller's: the job API binds each trainer id of a job to the key the
trainer sends with every call (`trainer_key`, random bytes it keeps for its lifetime), and
refuses a call under that id with another key.

Any token holder may lease and report as a trainer (a friend's trainer has the invite and
nothing else), and the step coordinator knows trainers by the id each names. Before, a caller
naming another trainer's id renewed that trainer's leases for as long as it liked, or gave them
back; with its own id it still reported microbatches leased to others (the ledger now takes a
report only from a trainer that leased its microbatch: `StepLedger.leased_to`).

An id unheard for `FORGET_S` is forgotten: it holds no lease by then (a lease runs out
`lease_timeout_s` after its trainer was last heard, and the job file bounds that by
`MAX_LEASE_TIMEOUT_S`). At most `MAX_TRAINERS` ids are remembered at once, for all jobs: past it
the id heard from least recently makes room for a new one, unless it was heard within `KEEP_S`
(then the new one is refused, RESOURCE_EXHAUSTED). A working trainer calls far more often than
that, so its binding is never taken from it while it works, and one forgotten is bound again by
its own caller's next call. Before, a new id was refused until an old one was forgotten: one
caller registering `MAX_TRAINERS` ids an hour (18 calls a second) refused every new trainer of
every job; now it takes a new id every `KEEP_S / MAX_TRAINERS` (over a thousand a second)."""

from __future__ import annotations

import hashlib
import hmac
import time
from collections import OrderedDict
from collections.abc import Callable

from swarm.errors import InvalidArgument, PermissionDenied, ResourceExhausted
from swarm.job.schema import MAX_LEASE_TIMEOUT_S

__all__ = [
    "FORGET_S",
    "KEEP_S",
    "MAX_KEY_BYTES",
    "MAX_TRAINERS",
    "MIN_KEY_BYTES",
    "TrainerKeys",
    "embedded_trainer",
]

FORGET_S = MAX_LEASE_TIMEOUT_S
# An id heard within this is never forgotten for another: a trainer's calls (each lease, each
# report, a renewal every third of `lease_timeout_s`) come far more often while it works.
KEEP_S = 60.0
MAX_TRAINERS = 1 << 16  # about 200 bytes each: 13 MB at most
MIN_KEY_BYTES, MAX_KEY_BYTES = 16, 64


def embedded_trainer(job: str) -> str:
    """The id of the scheduler's own trainer of `job`: it calls the step coordinator in-process,
    never the job API, and the job API takes no call under it."""
    return f"{job}-embedded"


class TrainerKeys:
    """Which caller holds each trainer id: the digest of the key it first came with, per
    (job, id), and when it was last heard (`clock`: seconds)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._held: OrderedDict[tuple[str, str], tuple[bytes, float]] = OrderedDict()

    def check(self, job: str, trainer: str, key: bytes) -> None:
        """The call of `trainer` of `job` with `key` may go on: InvalidArgument without a key,
        PermissionDenied where another key holds the id, ResourceExhausted past
        `MAX_TRAINERS` ids all heard within `KEEP_S`."""
        if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
            raise InvalidArgument(
                f"a trainer's call carries its key, {MIN_KEY_BYTES} to {MAX_KEY_BYTES} random "
                f"bytes (trainer_key), not {len(key)}: a trainer older than this scheduler "
                "sends none (update it)"
            )
        if trainer == embedded_trainer(job):
            raise PermissionDenied(
                f"trainer id {trainer!r} is the scheduler's own trainer of job {job}: a trainer "
                "speaks for its own leases only (choose an id of your own)"
            )
        now, digest = self._clock(), hashlib.sha256(key).digest()
        self._forget(now)
        held = self._held.get((job, trainer))
        if held is not None and not hmac.compare_digest(held[0], digest):
            raise PermissionDenied(
                f"trainer id {trainer!r} of job {job} is another caller's (its key differs): a "
                "trainer speaks for its own leases only (choose an id of your own)"
            )
        if held is None and len(self._held) >= MAX_TRAINERS:
            (oldest, (_, heard)) = next(iter(self._held.items()))
            if heard > now - KEEP_S:
                raise ResourceExhausted(
                    f"{MAX_TRAINERS} trainer ids were heard within {KEEP_S:g} s (swarm's "
                    "MAX_TRAINERS): a new one is taken once one is silent for longer"
                )
            del self._held[oldest]  # its own caller's next call binds it again
        self._held[(job, trainer)] = (digest, now)
        self._held.move_to_end((job, trainer))

    def _forget(self, now: float) -> None:
        while self._held and next(iter(self._held.values()))[1] < now - FORGET_S:
            self._held.popitem(last=False)
