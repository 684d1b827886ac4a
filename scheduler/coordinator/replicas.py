"""What the step coordinator asks of one replica of one stage (`StageReplica`), its gRPC form over
`StageClient`, and the cache of those connections (`ReplicaClients`).

The coordinator sees only `swarm.errors`: a replica that does not answer, or answers as another
job's or stage's, is `GONE`; `Aborted` is a round another member spoiled."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import torch

from scheduler.coordinator.trust.sum_checks import Checksums
from swarm.errors import NotFound, PeerUnavailable
from swarm.job.config import JobConfig
from swarm.job.rule import EagerOp
from swarm.model.state_checks import StateChecks
from swarm.net.commit_auth import SchedulerKey, SignedStub
from swarm.policy.parts import EQUAL_PARTS, Parts
from swarm.proto import stage_pb2 as pb
from swarm.rpc.lease import Replica
from swarm.rpc.stage_client import StageClient, StateSink

__all__ = [
    "GONE",
    "ExpectedStates",
    "GrpcReplica",
    "GrpcReplicas",
    "ReplicaClients",
    "ReplicaFactory",
    "StageReplica",
    "grpc_replicas",
]

# The replica is gone (dead, partitioned, or another process at its address now): not a refusal.
GONE = (PeerUnavailable, NotFound)


class StageReplica(Protocol):
    """One replica of one stage, as the coordinator drives it; every call raises `swarm.errors`."""

    async def info(self) -> pb.StageInfoResponse:
        """Its job, stage, step and the microbatches it holds receipts for."""
        ...

    async def prepare(
        self,
        step: int,
        microbatches: list[int],
        total_samples: int,
        group: list[str],
        group_index: int,
        round: str,
        *,
        parts: Parts = EQUAL_PARTS,
        checks: Checksums | None = None,
        peers: Sequence[str] = (),
    ) -> float | None:
        """Phase one: check it holds exactly `microbatches`, and average with `group` (its
        stage's replicas, itself at `group_index`, then any aggregators: the members past the
        first `parts.contributors`, 0 none) over `total_samples`, in `parts` (their weights one
        per member; none: equal). Returns the squared norm of the averaged gradient (None: it
        applied `step` already). `checks`: the checksums of every part asked with
        its seed, and filled in with its answer (`sum_checks`). `peers`: the group's peer ids in
        its order, which the round ticket a scheduler signs names (`swarm.net.round_tickets`)."""
        ...

    async def apply(self, step: int, scale: float = 1.0) -> None:
        """Phase two: the optimizer step with the prepared gradient times `scale` (clipping)."""
        ...

    async def prepare_round(
        self,
        boundary: int,
        total_samples: int,
        group: list[str],
        group_index: int,
        round: str,
        *,
        parts: Parts = EQUAL_PARTS,
        checks: Checksums | None = None,
        peers: Sequence[str] = (),
    ) -> bool:
        """pool.mode = "local": phase one of the round ending before step `boundary`: average
        its pseudo-gradient with `group` over the group's `total_samples` samples of the
        round (parts and `checks` as `prepare`'s). True: it applied that round already."""
        ...

    async def apply_round(self, boundary: int) -> None:
        """Phase two: the round's outer step."""
        ...

    async def eager(
        self,
        op: EagerOp,
        boundary: int,
        total_samples: int = 0,
        group: list[str] | None = None,
        group_index: int = 0,
        round: str = "",
        *,
        parts: Parts = EQUAL_PARTS,
        checks: Checksums | None = None,
        peers: Sequence[str] = (),
    ) -> bool:
        """pool.overlap = "eager": operation `op` of the round ending before step `boundary`
        (`EagerOp.STEP` is local; `EagerOp.AVERAGE`, `EagerOp.LAST`'s PREPARE and
        `EagerOp.MEAN` sum with `group`, parts and `checks` as `prepare`'s; `EagerOp.LAST`'s
        APPLY is `eager_last_apply`). True: it applied that round's step before."""
        ...

    async def eager_last_apply(self, boundary: int) -> None:
        """The job's last round's outer step with the sum `eager(EagerOp.LAST, ...)` prepared."""
        ...

    async def discard(self, step: int) -> int:
        """Drop its gradients of `step` (they are replayed elsewhere); returns how many."""
        ...

    async def join(
        self, source: str, step: int, source_peer: str = "", rollback_epoch: int = 0
    ) -> int:
        """Copy the replica at `source` (peer `source_peer`) in the background until at `step`
        (the open step); returns the step it is at now: `step` once it is a copy to admit, else
        keep asking. Work leased before `rollback_epoch` (the coordinator's) is refused from
        then on (`swarm.rpc.epoch`): a replica that joins after a rollback loaded no state of
        it."""
        ...

    async def load_state(
        self, step: int, state: dict[str, torch.Tensor], rollback_epoch: int = 0
    ) -> int:
        """Load `state`, of `step`; work leased before `rollback_epoch` is refused from now on
        (`swarm.rpc.epoch`)."""
        ...

    async def download_state(
        self, include_optimizer: bool = False, prefix: str = "param/"
    ) -> tuple[int, dict[str, torch.Tensor]]: ...

    async def stream_state(self, sink: StateSink, include_optimizer: bool = False) -> int:
        """`download_state` tensor by tensor into `sink` (names unchanged); the state's step."""
        ...

    async def max_state_tensors(self) -> int:
        """The most tensors a state of this stage may hold (a file's room for their names)."""
        ...

    async def close(self) -> None: ...


# (stage, replica) -> a connection to that replica at that stage
ReplicaFactory = Callable[[int, Replica], StageReplica]


class ExpectedStates:
    """What a state downloaded from a replica of each stage of `job` is checked against
    (`StateChecks`), built once per stage and shared by the stage's replicas. Built in a worker
    thread: it builds the stage's modules (on the meta device), seconds for a large model, and
    the event loop (the job API, the embedded broker) must not wait on that."""

    def __init__(self, job: JobConfig) -> None:
        self.job = job
        self._built: dict[int, asyncio.Task[StateChecks]] = {}

    async def get(self, stage: int) -> StateChecks:
        task = self._built.get(stage)
        if task is None:  # the first caller builds; callers meanwhile wait for the same
            task = asyncio.ensure_future(asyncio.to_thread(StateChecks, self.job, stage))
            self._built[stage] = task
        try:
            return await asyncio.shield(task)  # a caller cancelled leaves the build to the rest
        except Exception:
            if self._built.get(stage) is task:
                del self._built[stage]  # failed: the next caller tries again
            raise


class GrpcReplica:
    """`StageReplica` over a `StageClient` (which already converts gRPC errors)."""

    def __init__(
        self,
        client: StageClient,
        expected: ExpectedStates | None = None,
        tickets: Callable[[str], bytes] | None = None,
    ) -> None:
        """`expected`: the job's, shared by its replicas (by default, this replica's own).
        `tickets(source_peer)`: the scheduler's ticket naming this replica a follower of that
        peer (`swarm.net.follow_tickets`), given with each `Join`; None: no scheduler."""
        self.client, self.tickets = client, tickets
        self.expected = expected or ExpectedStates(client.job)

    async def info(self) -> pb.StageInfoResponse:
        return await self.client.info()

    async def prepare(
        self,
        step: int,
        microbatches: list[int],
        total_samples: int,
        group: list[str],
        group_index: int,
        round: str,
        *,
        parts: Parts = EQUAL_PARTS,
        checks: Checksums | None = None,
        peers: Sequence[str] = (),
    ) -> float | None:
        response = await self.client.commit(
            step,
            microbatches,
            total_samples,
            phase=pb.COMMIT_PHASE_PREPARE,
            group=group,
            group_index=group_index,
            round=round,
            parts=parts,
            group_peers=peers,
            check_seed=checks.seed if checks is not None else 0,
            audit_seeds=checks.audit_seeds if checks is not None else (),
        )
        if checks is not None:
            checks.reports = list(response.sum_checks)
            checks.audit_reports = list(response.audit_checks)
        return None if response.already_committed else response.grad_sq_norm

    async def apply(self, step: int, scale: float = 1.0) -> None:
        await self.client.commit(step, [], 0, phase=pb.COMMIT_PHASE_APPLY, grad_scale=scale)

    async def prepare_round(
        self,
        boundary: int,
        total_samples: int,
        group: list[str],
        group_index: int,
        round: str,
        *,
        parts: Parts = EQUAL_PARTS,
        checks: Checksums | None = None,
        peers: Sequence[str] = (),
    ) -> bool:
        response = await self.client.commit(
            boundary,
            [],
            total_samples,
            phase=pb.COMMIT_PHASE_PREPARE,
            group=group,
            group_index=group_index,
            round=round,
            round_end=True,
            parts=parts,
            group_peers=peers,
            check_seed=checks.seed if checks is not None else 0,
        )
        if checks is not None:
            checks.reports = list(response.sum_checks)
        return response.already_committed

    async def apply_round(self, boundary: int) -> None:
        await self.client.commit(boundary, [], 0, phase=pb.COMMIT_PHASE_APPLY, round_end=True)

    async def eager(
        self,
        op: EagerOp,
        boundary: int,
        total_samples: int = 0,
        group: list[str] | None = None,
        group_index: int = 0,
        round: str = "",
        *,
        parts: Parts = EQUAL_PARTS,
        checks: Checksums | None = None,
        peers: Sequence[str] = (),
    ) -> bool:
        apply = op == EagerOp.STEP
        response = await self.client.commit(
            boundary,
            [],
            total_samples,
            phase=pb.COMMIT_PHASE_APPLY if apply else pb.COMMIT_PHASE_PREPARE,
            group=group,
            group_index=group_index,
            round=round,
            round_end=True,
            eager=op,
            parts=parts,
            group_peers=peers,
            check_seed=checks.seed if checks is not None else 0,
        )
        if checks is not None:
            checks.reports = list(response.sum_checks)
        return response.already_committed

    async def eager_last_apply(self, boundary: int) -> None:
        await self.client.commit(
            boundary, [], 0, phase=pb.COMMIT_PHASE_APPLY, round_end=True, eager=EagerOp.LAST
        )

    async def discard(self, step: int) -> int:
        return await self.client.discard(step)

    async def join(
        self, source: str, step: int, source_peer: str = "", rollback_epoch: int = 0
    ) -> int:
        ticket = self.tickets(source_peer) if self.tickets is not None and source_peer else b""
        return await self.client.join(source, step, ticket, rollback_epoch)

    async def load_state(
        self, step: int, state: dict[str, torch.Tensor], rollback_epoch: int = 0
    ) -> int:
        return await self.client.load_state(step, state, rollback_epoch)

    async def download_state(
        self, include_optimizer: bool = False, prefix: str = "param/"
    ) -> tuple[int, dict[str, torch.Tensor]]:
        # Checked against the stage's layout as it comes: a member that sends more than the
        # stage's state, or a tensor no replica would load, is refused (no checkpoint from it).
        expect = await self.expected.get(self.client.stage)
        return await self.client.download_state(include_optimizer, prefix, expect=expect)

    async def stream_state(self, sink: StateSink, include_optimizer: bool = False) -> int:
        expect = await self.expected.get(self.client.stage)
        return await self.client.stream_state(sink, include_optimizer, expect=expect)

    async def max_state_tensors(self) -> int:
        return (await self.expected.get(self.client.stage)).max_state_tensors()

    async def close(self) -> None:
        await self.client.close()


class GrpcReplicas:
    """The `ReplicaFactory` of a job's real replicas, sharing one `ExpectedStates`."""

    def __init__(
        self,
        job: JobConfig,
        job_id: str,
        token: str | None = None,
        signing: SchedulerKey | None = None,
    ) -> None:
        """`signing`: the scheduler's key, which its commit-protocol calls are signed with."""
        self.job, self.job_id, self.token, self.signing = job, job_id, token, signing
        self.expected = ExpectedStates(job)  # one per stage, whichever replica asks first

    def __call__(self, stage: int, replica: Replica) -> StageReplica:
        client = StageClient(replica.address, self.job, self.job_id, stage, self.token)
        if self.signing is None:
            return GrpcReplica(client, self.expected)
        # The commit protocol's calls speak for the scheduler, and so does naming this replica
        # a follower of the source it is told to copy.
        key, job_id, follower = self.signing, self.job_id, replica.peer
        client.stub = SignedStub(client.stub, key.signer(follower), job_id, stage)
        return GrpcReplica(
            client,
            self.expected,
            lambda source: key.ticket(job_id, stage, follower, source),
        )

    async def prepare(self) -> None:
        """Build every stage's checks before the first step: a checkpoint that waited for them
        (seconds, in a thread) would find its replicas steps past the one it was for."""
        await asyncio.gather(*(self.expected.get(s) for s in range(self.job.training.stages)))


def grpc_replicas(
    job: JobConfig, job_id: str, token: str | None = None, signing: SchedulerKey | None = None
) -> GrpcReplicas:
    return GrpcReplicas(job, job_id, token, signing)


class ReplicaClients:
    """One connection per (peer, stage, address): a peer moved by rebalancing serves another
    stage, and a peer restarted under its name may listen elsewhere."""

    def __init__(self, factory: ReplicaFactory, grace_s: float = 0.0) -> None:
        self.factory, self.grace_s = factory, grace_s
        self._open: dict[tuple[str, int, str], StageReplica] = {}
        # each delayed close, with the clients it closes: `close` closes those at once
        self._closing: dict[asyncio.Task[None], list[StageReplica]] = {}

    def get(self, stage: int, replica: Replica) -> StageReplica:
        key = (replica.peer, stage, replica.address)
        if key not in self._open:
            self._open[key] = self.factory(stage, replica)
        return self._open[key]

    async def keep(self, members: Iterable[Iterable[Replica]]) -> None:
        """Close the connections to replicas that are no longer members as they were (left,
        moved, or restarted elsewhere), so the cache holds the current members only."""
        current = {(r.peer, k, r.address) for k, stage in enumerate(members) for r in stage}
        stale = [self._open.pop(key) for key in list(self._open) if key not in current]
        if stale:
            self._close_later(stale)

    def drop(self, stage: int, replica: Replica) -> None:
        """Forget the connection to a replica that did not answer: the next call dials anew.
        A gRPC channel that failed to connect waits out its own reconnect backoff (up to 5 s)
        and fails every call meanwhile, so a peer restarted at the same address was not asked
        again until then, and again after each of its calls failed that way."""
        client = self._open.pop((replica.peer, stage, replica.address), None)
        if client is not None:
            self._close_later([client])

    def _close_later(self, clients: list[StageReplica]) -> None:
        # Closing a channel cancels its calls in flight (a void's Discard, an export's
        # download): let them run to their deadlines first.
        task = asyncio.create_task(self._close_after(clients, self.grace_s))
        self._closing[task] = clients
        task.add_done_callback(lambda done: self._closing.pop(done, None))

    @staticmethod
    async def _close_after(clients: list[StageReplica], delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)

    async def close(self) -> None:
        """Every connection closed now: the open ones, and those waiting out their grace (their
        channels were left to the collector before)."""
        waiting = [c for task, cs in list(self._closing.items()) if task.cancel() for c in cs]
        clients, self._open = list(self._open.values()) + waiting, {}
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)

    def __len__(self) -> int:
        return len(self._open)
