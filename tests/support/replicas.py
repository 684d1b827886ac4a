"""In-memory replicas for the step coordinator's tests: `FakeReplica` implements
`scheduler.coordinator.replicas.StageReplica`, and a test controls the interleaving exactly by
holding a method at a `Gate` (the call waits there until the test lets it go) or queueing errors
for it to raise."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from swarm.errors import Aborted, FailedPrecondition, PeerUnavailable
from swarm.policy.parts import EQUAL_PARTS, Parts
from swarm.proto import stage_pb2 as pb
from swarm.proto import stage_pb2_grpc
from swarm.rpc.lease import Replica

__all__ = ["FakeReplica", "FakeSwarm", "Gate", "Prepared"]


@dataclass
class Gate:
    """Holds every call of one method: `entered` is set when one arrives; `open()` lets them
    through (the call then answers from the replica's state at that moment)."""

    entered: asyncio.Event = field(default_factory=asyncio.Event)
    opened: asyncio.Event = field(default_factory=asyncio.Event)

    def open(self) -> None:
        self.opened.set()


@dataclass
class Prepared:
    step: int
    microbatches: list[int]
    total_samples: int
    group: list[str]
    group_index: int
    round: str
    weights: tuple[float, ...] = ()  # the round's part weights (none: equal parts)
    contributors: int = 0


class FakeReplica:
    """One replica of one stage. Its state is a single tensor `w` holding its step, so a copy, a
    rollback or a checkpoint is visible in one number. `calls` names every call, in order."""

    def __init__(self, swarm: FakeSwarm, peer: str, stage: int, step: int = 0) -> None:
        self.swarm, self.peer, self.stage, self.step = swarm, peer, stage, step
        self.address = f"fake:{peer}"
        self.receipts: set[int] = set()
        self.runs: dict[int, int] = {}  # the run each receipt was accumulated under (none: 0)
        # (step, index, run) of each accumulating push it names in flight (its compute running)
        self.flying: list[tuple[int, int, int]] = []
        self.state: dict[str, torch.Tensor] = {"w": torch.tensor([float(step)])}
        self.prepared: Prepared | None = None
        self.calls: list[tuple[str, Any]] = []
        self.gates: dict[str, Gate] = {}
        self.failures: dict[str, list[BaseException]] = {}
        self.unreachable: set[str] = set()  # addresses whose PoolService this one cannot reach
        self.awaited: set[str] = set()  # addresses whose parts never come: their rounds wait
        self.sq_norm = 0.0  # what PREPARE answers: the squared norm of its averaged gradient
        self.applied: tuple[int, float] = (-1, 1.0)  # (step, clipping coefficient) applied last
        self.scales: list[float] = []  # the clipping coefficient of every APPLY, in order
        # pool rounds: the last round's end applied here, and its samples since (a test sets
        # them for a resuming coordinator; the fake does no local steps of its own)
        self.round_synced, self.round_samples = -1, 0
        # Where its Info answer comes from over the wire (a real server: a hostile peer's), if
        # not from this fake itself.
        self.speaks_at: str | None = None
        self.closed = 0
        # (method, part weights, contributors) of every averaging call, in order
        self.parts: list[tuple[str, tuple[float, ...], int]] = []
        self.copying = 0  # Joins that find its copy still downloading (answered -1), first
        self.dead = False  # SIGKILLed: every call fails unreachable, and no copy of it ends
        # The rollback epoch it refuses older work of, as a real replica's (`swarm.rpc.epoch`):
        # its last LoadState's, or a Join's if newer; and that of the state it holds, which its
        # Info says: its last LoadState's, or the Join's whose copy it took.
        self.epoch = self.state_epoch = 0

    @property
    def replica(self) -> Replica:
        return Replica(self.peer, self.address)

    # -- test controls --------------------------------------------------------------------------
    def hold(self, method: str) -> Gate:
        self.gates[method] = gate = Gate()
        return gate

    def fail(self, method: str, *errors: BaseException) -> None:
        """The next calls of `method` raise these, one each."""
        self.failures.setdefault(method, []).extend(errors)

    def cannot_reach(self, *others: FakeReplica) -> None:
        """From now on, every round whose group holds one of `others` aborts here, naming them
        (as a real replica's averaging names the members it could not reach)."""
        self.unreachable.update(o.address for o in others)

    def waits_on(self, *others: FakeReplica) -> None:
        """From now on, every round whose group holds one of `others` waits here until its
        call is cancelled, as a real replica's averaging waits for a member that never sends
        its parts (hung, or moved away mid-round) until the round's averaging timeout."""
        self.awaited.update(o.address for o in others)

    async def _averaged(self, group: Sequence[str], round: str) -> None:
        """The round with `group` as this fake averages it: it waits on a member of
        `awaited`, else aborts naming those it `cannot_reach`."""
        if self.awaited.intersection(group):
            await asyncio.Event().wait()  # until cancelled
        missing = [i for i, address in enumerate(group) if address in self.unreachable]
        if missing:
            raise Aborted(f"{self.peer}: round {round} aborted: cannot reach {missing}", missing)

    def accumulate(self, index: int, run: int = 0) -> None:
        """A trainer's Backward added microbatch `index`'s gradient here (pushed as `run`)."""
        self.receipts.add(index)
        self.runs[index] = run

    def called(self, method: str) -> list[Any]:
        return [args for name, args in self.calls if name == method]

    async def _enter(self, method: str, args: Any = None) -> None:
        self.calls.append((method, args))
        self.swarm.log.append((self.peer, method))
        if self.dead:
            raise PeerUnavailable(f"UNAVAILABLE: {self.address}: Connection refused")
        gate = self.gates.get(method)
        if gate is not None:
            gate.entered.set()
            await gate.opened.wait()
        if self.failures.get(method):
            raise self.failures[method].pop(0)

    # -- StageReplica ---------------------------------------------------------------------------
    async def info(self) -> pb.StageInfoResponse:
        await self._enter("info")
        if self.speaks_at is not None:
            return await self._info_over_the_wire(self.speaks_at)
        return self.honest_info()

    async def _info_over_the_wire(self, address: str) -> pb.StageInfoResponse:
        """Its Info as a real StageService at `address` answers it: the bytes a peer sends,
        decoded as the coordinator's gRPC replica decodes them (a hostile peer's own words)."""
        async with grpc.aio.insecure_channel(address) as channel:
            reply: pb.StageInfoResponse = await stage_pb2_grpc.StageServiceStub(channel).Info(
                pb.StageInfoRequest(), timeout=10
            )
            return reply

    def honest_info(self) -> pb.StageInfoResponse:
        """What this replica would answer to Info, as it is."""
        return pb.StageInfoResponse(
            peer=self.peer,
            job=self.swarm.job_id,
            stage=self.stage,
            num_stages=len(self.swarm.stages),
            step=self.step,
            pending_microbatches=len(self.receipts),
            receipts=sorted(self.receipts),
            receipt_runs=[self.runs.get(index, 0) for index in sorted(self.receipts)],
            applied_step=self.applied[0],
            applied_scale=self.applied[1],
            round_synced=self.round_synced,
            round_samples=self.round_samples,
            state_epoch=self.state_epoch,
            in_flight=[pb.PushInFlight(step=s, index=i, run=r) for s, i, r in self.flying],
        )

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
        checks: object = None,  # a fake averages nothing: it reports no checksums
        peers: Sequence[str] = (),
    ) -> float | None:
        args = Prepared(
            step,
            list(microbatches),
            total_samples,
            list(group),
            group_index,
            round,
            parts.weights,
            parts.contributors,
        )
        self.parts.append(("prepare", parts.weights, parts.contributors))
        _peers_named(group, peers)
        await self._enter("prepare", args)
        if step != self.step or sorted(self.receipts) != sorted(microbatches):
            raise FailedPrecondition(f"{self.peer} holds {sorted(self.receipts)} at {self.step}")
        await self._averaged(group, round)
        self.prepared = args
        return self.sq_norm

    async def prepare_round(
        self,
        boundary: int,
        total_samples: int,
        group: list[str],
        group_index: int,
        round: str,
        *,
        parts: Parts = EQUAL_PARTS,
        checks: object = None,  # a fake averages nothing: it reports no checksums
        peers: Sequence[str] = (),
    ) -> bool:
        self.parts.append(("prepare_round", parts.weights, parts.contributors))
        _peers_named(group, peers)
        await self._enter("prepare_round", (boundary, total_samples, list(group), round))
        if boundary != self.step:
            raise FailedPrecondition(f"{self.peer} is at {self.step}, not at {boundary}")
        await self._averaged(group, round)
        return False

    async def apply_round(self, boundary: int) -> None:
        await self._enter("apply_round", boundary)

    async def eager(
        self,
        op: int,
        boundary: int,
        total_samples: int = 0,
        group: list[str] | None = None,
        group_index: int = 0,
        round: str = "",
        *,
        parts: Parts = EQUAL_PARTS,
        checks: object = None,  # a fake averages nothing: it reports no checksums
        peers: Sequence[str] = (),
    ) -> bool:
        name = pb.EagerOp.Name(op).lower()  # "eager_step", "eager_average", ...
        self.parts.append((name, parts.weights, parts.contributors))
        _peers_named(group or [], peers)
        await self._enter(name, (boundary, total_samples, list(group or []), round))
        await self._averaged(group or [], round)
        return False

    async def eager_last_apply(self, boundary: int) -> None:
        await self._enter("eager_last_apply", boundary)

    async def apply(self, step: int, scale: float = 1.0) -> None:
        await self._enter("apply", step)
        if step < self.step:  # as a real replica: one it applied answers that it had
            return
        self.scales.append(scale)
        if self.prepared is None or self.prepared.step != step:
            raise FailedPrecondition(f"{self.peer}: step {step} is not prepared")
        self.applied = (step, scale)
        self.step, self.prepared = step + 1, None
        self.state = {"w": torch.tensor([float(self.step)])}
        self.receipts.clear()

    async def discard(self, step: int) -> int:
        await self._enter("discard", step)
        dropped = len(self.receipts) if step == self.step else 0
        if step == self.step:  # as a real replica: its gradients and what it prepared
            self.receipts.clear()
            self.prepared = None
        return dropped

    async def join(
        self, source: str, step: int, source_peer: str = "", rollback_epoch: int = 0
    ) -> int:
        """A copy that completes at once: it answers `step` when `source` is at it (a real
        replica gets there by following the source's updates). -1 while its copy downloads
        (`copying`), and for a dead source (its copy failed: a Join naming a live one starts
        another)."""
        await self._enter("join", source)
        if rollback_epoch < self.epoch:  # as a real replica: sent before a rollback it loaded
            raise FailedPrecondition(f"{self.peer}: a Join sent before the rollback: stale")
        self.epoch = max(self.epoch, rollback_epoch)
        other = self.swarm.by_address[source]
        if other.dead:
            return -1
        if self.copying:
            self.copying -= 1
            return -1
        self.step, self.state = other.step, {k: v.clone() for k, v in other.state.items()}
        self.state_epoch = rollback_epoch
        self.receipts.clear()
        self.applied = (-1, 1.0)
        return self.step

    async def load_state(
        self, step: int, state: dict[str, torch.Tensor], rollback_epoch: int = 0
    ) -> int:
        await self._enter("load_state", step)
        self.step, self.state = step, {k: v.clone() for k, v in state.items()}
        self.epoch = self.state_epoch = rollback_epoch
        self.receipts.clear()
        self.applied = (-1, 1.0)
        return step

    async def download_state(
        self, include_optimizer: bool = False, prefix: str = "param/"
    ) -> tuple[int, dict[str, torch.Tensor]]:
        await self._enter("download_state")
        return self.step, {k: v.clone() for k, v in self.state.items()}

    async def stream_state(self, sink: Any, include_optimizer: bool = False) -> int:
        await self._enter("download_state")
        step, state = self.step, {k: v.clone() for k, v in self.state.items()}
        for name, tensor in state.items():
            await sink(step, name, tensor)
        return step

    async def max_state_tensors(self) -> int:
        return len(self.state)

    async def close(self) -> None:
        self.closed += 1


class FakeSwarm:
    """The replicas of every stage; `members` is what the peer registry would say now, and
    `connect` is the coordinator's replica factory."""

    def __init__(self, job_id: str, stages: int) -> None:
        self.job_id = job_id
        self.stages: list[list[FakeReplica]] = [[] for _ in range(stages)]
        self.by_address: dict[str, FakeReplica] = {}
        self.log: list[tuple[str, str]] = []  # (peer, method) of every call, in order

    def add(self, stage: int, peer: str, step: int = 0) -> FakeReplica:
        replica = FakeReplica(self, peer, stage, step)
        self.stages[stage].append(replica)
        self.by_address[replica.address] = replica
        return replica

    def remove(self, peer: str) -> None:
        """The peer left: the registry no longer lists it (it answers no more)."""
        for stage in self.stages:
            for r in stage:
                if r.peer == peer:
                    r.dead = True  # the coordinator may still call it where it was
            stage[:] = [r for r in stage if r.peer != peer]

    def members(self) -> list[list[Replica]]:
        return [[r.replica for r in stage] for stage in self.stages]

    def connect(self, stage: int, replica: Replica) -> FakeReplica:
        found = self.by_address[replica.address]
        assert found.stage == stage, f"{found.peer} serves stage {found.stage}, not {stage}"
        return found

    def __getitem__(self, peer: str) -> FakeReplica:
        return next(r for stage in self.stages for r in stage if r.peer == peer)


def _peers_named(group: Sequence[str], peers: Sequence[str]) -> None:
    """A round with others names its members' peer ids, as a real replica's round ticket needs
    (`swarm.net.commit_auth` refuses to sign one without)."""
    if len(group) > 1 and len(peers) != len(group):
        raise AssertionError(f"a round of {list(group)} named peer ids {list(peers)}")
