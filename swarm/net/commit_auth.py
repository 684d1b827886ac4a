"""The commit protocol speaks for the scheduler alone: its calls are signed with the scheduler's
key, and a replica under a scheduler takes no other.

The swarm token lets any peer operator call a stage's RPCs, so a token holder could otherwise call
`Commit`, `Discard`, `Join` or `LoadState` with well-formed wrong values (a step applied early,
a group of its own, a source to copy of its own, a state of its own) and disturb every replica of
a step. The scheduler holds an Ed25519 key (`SchedulerKey`, a file of its own, kept across
restarts) and announces the public half in each job's retained announcement, a topic only it may
publish on (the brokers' ACL). A replica serving a job the scheduler assigned verifies
(`CommitVerifier`) each such call's signature, sent in its metadata, over the method, the replica
it is for (its peer id: a call signed for one replica is refused by the others), a time and a
nonce (a call is taken once, and only within `MAX_AGE_S` of when it was signed) and the request
itself (every field: the step, `group`, `source`, the phase, ...); a `LoadState` also the state it
streams, by its digest (`state_digest`, sent beside the signature under `STATE_DIGEST_KEY`),
which the replica checks once the state has come and before it loads it. A call signed before
the replica's process started is refused too (`STARTED`): the nonces it took are gone with its
last process, and a call seen then must not be played to the restarted one (issue 54). A stage
server not under a
scheduler (`swarm trainer --stage-servers`, whose owner coordinates it) has no key to check
against, and takes the token alone, as before.
"""

from __future__ import annotations

import hashlib
import os
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import torch
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from google.protobuf.message import Message

from swarm.net.follow_tickets import issue_ticket
from swarm.net.lease_tickets import issue_lease_ticket
from swarm.net.round_tickets import issue_round_ticket
from swarm.proto import stage_pb2 as pb

__all__ = [
    "KEY_FILE",
    "MAX_AGE_S",
    "SIGNATURE_KEY",
    "STARTED",
    "STATE_DIGEST_KEY",
    "CallSigner",
    "CommitRefused",
    "CommitVerifier",
    "SchedulerKey",
    "SignedStub",
    "state_digest",
]

#: The binary metadata entry a signed call carries: issued (ms, 8 bytes), nonce (16), signature.
SIGNATURE_KEY = "swarm-scheduler-signature-bin"
#: A signed call is taken this long after (or before: clocks differ) the time it was signed: the
#: clock skew a peer accepts of the scheduler (`stage_server.agent.MAX_CLOCK_SKEW_S`).
MAX_AGE_S = 300.0
#: The scheduler's key, in its checkpoint directory (0600).
KEY_FILE = "scheduler-commit-key"
#: Public keys of scheduler keys that were published (a run's key committed to the repository
#: with 1cb5e785, gone since 702396c5): whoever cloned it holds the private key, so a scheduler
#: refuses to sign with one. A clone that ran a scheduler from its root may still have the file.
PUBLISHED = frozenset(
    {bytes.fromhex("1509bbd13af203552ccb98e99384afd2b359587c17d8c144b1260c13fdde2735")}
)
#: The binary metadata entry of a signed LoadState: the digest of the state it streams.
STATE_DIGEST_KEY = "swarm-state-digest-bin"
#: When this process started (its clock): a call signed before is refused, whatever its nonce.
#: The price, where the scheduler's clock is behind this one: its calls are refused for that
#: long after a restart (docs/decisions.md, "Nonces across a restart").
STARTED = time.time()

_CONTEXT = b"swarm-commit/1\0"
_HEAD = struct.Struct(">q16s")  # issued (ms), nonce
_SIGNATURE_BYTES = 64
_MAX_NONCES = 65_536  # calls remembered per replica within MAX_AGE_S (only signed ones get here)

Metadata = Sequence[tuple[str, str | bytes]]


def _signed(method: str, peer: str, head: bytes, request: Message, extra: bytes = b"") -> bytes:
    body = request.SerializeToString(deterministic=True)
    parts = (_CONTEXT, method.encode(), b"\0", peer.encode(), b"\0", head, extra, body)
    return b"".join(parts)


def state_digest(step: int, state: Mapping[str, torch.Tensor]) -> bytes:
    """SHA-256 of a state as LoadState streams it: its step, and each tensor's name, dtype, shape
    and bytes, in name order (the order it travels in does not count)."""
    digest = hashlib.sha256(struct.pack(">q", step))
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.digest()


class CallSigner:
    """Signs the commit-protocol calls to one replica (`peer`)."""

    def __init__(self, key: Ed25519PrivateKey, peer: str) -> None:
        self._key, self.peer = key, peer

    def metadata(
        self, method: str, request: Message, extra: bytes = b""
    ) -> tuple[tuple[str, bytes], ...]:
        head = _HEAD.pack(int(time.time() * 1000), os.urandom(16))
        signature = self._key.sign(_signed(method, self.peer, head, request, extra))
        return ((SIGNATURE_KEY, head + signature),)

    def with_round_ticket(self, request: pb.StageCommitRequest) -> pb.StageCommitRequest:
        """`request`, a commit call of a round with others, with the ticket that proves this
        replica a member of it to the round's owners (`swarm.net.round_tickets`)."""
        if len(request.group) < 2 or not request.round or request.HasField("round_ticket"):
            return request
        if len(request.group_peers) != len(request.group):  # the coordinator's own mistake
            raise ValueError(
                f"round {request.round!r}: {len(request.group_peers)} peer ids for a group of "
                f"{len(request.group)}: a round ticket names each member's"
            )
        ticketed = pb.StageCommitRequest()
        ticketed.CopyFrom(request)
        ticketed.round_ticket.CopyFrom(
            issue_round_ticket(
                self._key,
                job=request.job,
                stage=request.stage,
                round=request.round,
                sender=request.group_index,
                peers=request.group_peers,
                contributors=request.contributors,
                now=time.time(),
            )
        )
        return ticketed


class SchedulerKey:
    """The scheduler's signing key."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        self.public = key.public_key().public_bytes_raw()

    @classmethod
    def generate(cls) -> SchedulerKey:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, path: Path) -> SchedulerKey:
        """The key in `path`, made there (0600) on first use: a restarted scheduler keeps its
        key, so the replicas of the jobs it resumes take its calls at once."""
        try:
            found = cls(Ed25519PrivateKey.from_private_bytes(path.read_bytes()))
        except FileNotFoundError:
            pass
        except ValueError as e:
            raise ValueError(f"{path} is not a scheduler key ({e}); remove it to make one") from e
        else:
            if found.public in PUBLISHED:
                raise ValueError(
                    f"{path} is a scheduler key that was published (committed to swarm's "
                    "repository): anyone may sign as this scheduler with it. Remove it to make "
                    "one (the replicas of the jobs it runs then take the new key's calls once "
                    "the jobs are announced again)"
                )
            return found
        key = Ed25519PrivateKey.generate()
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:  # its owner's only, whatever the umask
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process made it meanwhile: theirs
            return cls.load_or_create(path)
        with os.fdopen(fd, "wb") as f:
            f.write(key.private_bytes_raw())
        return cls(key)

    def signer(self, peer: str) -> CallSigner:
        return CallSigner(self._key, peer)

    def ticket(self, job: str, stage: int, follower: str, source: str) -> bytes:
        """The ticket naming `follower` a follower of `source` (peer ids) in `stage` of `job`,
        which the coordinator's `Join` gives the joiner (`swarm.net.follow_tickets`)."""
        return issue_ticket(self._key, job, stage, follower, source, time.time())

    def lease_ticket(
        self, job: str, step: int, index: int, epoch: int, stage: int, run: int = 0
    ) -> bytes:
        """The ticket of microbatch `(step, index)` of `job` leased in rollback epoch `epoch`,
        at `stage`, pushed as run `run` (0: on the carry plane, or keeping no record), which
        its lessee's accumulating call there carries (`swarm.net.lease_tickets`)."""
        return issue_lease_ticket(self._key, job, step, index, epoch, stage, run)


class SignedStub:
    """A `StageServiceStub` whose commit-protocol calls carry `signer`'s signature (the stub of
    a `StageClient` to replica `signer.peer` of `stage` of `job`); its other calls are the
    stub's own."""

    def __init__(self, stub: Any, signer: CallSigner, job: str, stage: int) -> None:
        self._stub, self._signer, self._job, self._stage = stub, signer, job, stage

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stub, name)

    def Commit(self, request: pb.StageCommitRequest, **kwargs: Any) -> Any:
        request = self._signer.with_round_ticket(request)  # signed with the call
        return self._stub.Commit(
            request, metadata=self._signer.metadata("Commit", request), **kwargs
        )

    def Discard(self, request: pb.StageDiscardRequest, **kwargs: Any) -> Any:
        return self._stub.Discard(
            request, metadata=self._signer.metadata("Discard", request), **kwargs
        )

    def Join(self, request: pb.StageJoinRequest, **kwargs: Any) -> Any:
        return self._stub.Join(request, metadata=self._signer.metadata("Join", request), **kwargs)

    def LoadState(self, *, metadata: Metadata = (), **kwargs: Any) -> Any:
        # A stream: what is signed is its job and stage, before any tensor (a replica refuses an
        # unsigned one before it reads a byte of state), and the digest of the state it streams
        # (`StageClient.load_state` sends it under STATE_DIGEST_KEY), checked once it came.
        signed = pb.StageLoadStateRequest(job=self._job, stage=self._stage)
        digest = _digest_of(metadata)
        signature = self._signer.metadata("LoadState", signed, digest)
        return self._stub.LoadState(metadata=(*metadata, *signature), **kwargs)


def _digest_of(metadata: Metadata) -> bytes:
    """The state digest a LoadState carries (b"" when none)."""
    value = next((v for k, v in metadata if k == STATE_DIGEST_KEY), b"")
    return value if isinstance(value, bytes) else value.encode()


class CommitRefused(Exception):
    """A commit-protocol call not signed by the scheduler: `code` is what it is refused with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class CommitVerifier:
    """What a replica (`peer`) checks a commit-protocol call against: `public`, the key its
    scheduler announced."""

    def __init__(
        self,
        public: bytes,
        peer: str,
        clock: Callable[[], float] = time.time,
        started: float | None = None,
    ) -> None:
        self.public, self.peer, self.clock = public, peer, clock
        self._key = Ed25519PublicKey.from_public_bytes(public)
        self._seen: OrderedDict[bytes, int] = OrderedDict()  # nonce -> issued (ms), oldest first
        # Issued at or before this: forgotten (or taken by a process before this one), so
        # refused. `started`: when this replica's process started (`STARTED`).
        self._floor_ms = int((STARTED if started is None else started) * 1000)

    def check(self, method: str, request: Message, metadata: Metadata | None) -> None:
        """Raise `CommitRefused` unless `request` to `method` is the scheduler's, signed for this
        replica, fresh, and not taken before (a LoadState: with the digest of its state under
        `STATE_DIGEST_KEY`, which the signature covers)."""
        value = next((v for k, v in metadata or () if k == SIGNATURE_KEY), None)
        if value is None:
            raise CommitRefused(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{method} is the scheduler's: this replica takes it only signed by the "
                "scheduler's key (the swarm token is not enough)",
            )
        raw = value if isinstance(value, bytes) else value.encode()
        if len(raw) != _HEAD.size + _SIGNATURE_BYTES:
            raise CommitRefused(
                grpc.StatusCode.PERMISSION_DENIED, f"{method}: a malformed scheduler signature"
            )
        head, signature = raw[: _HEAD.size], raw[_HEAD.size :]
        issued_ms, nonce = _HEAD.unpack(head)
        extra = _digest_of(metadata or ()) if method == "LoadState" else b""
        try:
            self._key.verify(signature, _signed(method, self.peer, head, request, extra))
        except InvalidSignature:
            raise CommitRefused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method} is not signed by this job's scheduler for peer {self.peer}",
            ) from None
        age = self.clock() - issued_ms / 1000
        if abs(age) > MAX_AGE_S:
            raise CommitRefused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method} was signed {age:.0f} s from now (more than {MAX_AGE_S:.0f} s): a "
                "replay, or the scheduler's clock is wrong",
            )
        if nonce in self._seen or issued_ms <= self._floor_ms:
            raise CommitRefused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method}: a signed call taken before, or signed before this replica started "
                "(a replay; or the scheduler's clock is behind this one's)",
            )
        self._remember(nonce, issued_ms)

    def _remember(self, nonce: bytes, issued_ms: int) -> None:
        self._seen[nonce] = issued_ms
        horizon = (self.clock() - MAX_AGE_S) * 1000
        while self._seen:
            oldest, at = next(iter(self._seen.items()))
            if at >= horizon and len(self._seen) <= _MAX_NONCES:
                break
            # Forgotten: whatever was signed up to it is refused from now on (a full memory
            # must not let a replay through).
            del self._seen[oldest]
            if at >= horizon:
                self._floor_ms = max(self._floor_ms, at)
