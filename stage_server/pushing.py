"""The push data plane's next hop: a replica sends its outputs straight to a replica of the next
stage (`Push`), chosen as a trainer chooses, and collects what comes back along the same call
(the gradient of its outputs, every later stage's receipt, the loss).

Who to send to: the least-loaded healthy replica among those the request's route names, by the
smallest expected finish time (`swarm.policy.wiring`, fed by this replica's own in-flight calls
and measured service times). A replica that answers busy gets the next try elsewhere and is not
banned; one that fails is banned with backoff and the hop is tried on another.

Exactness: a failed call may have accumulated downstream all the same (it died after the
backward, say). Its stages are never asked to accumulate again from here: the later tries only
fetch the gradient this replica needs, and those stages go back to the trainer as `uncertain`:
the coordinator adopts the receipts a replica holds, or replays the stage (as it does for an
uncertain call of the relay plane).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field

import torch

from swarm.clock import MonotonicClock
from swarm.errors import Busy, PeerUnavailable, SwarmError
from swarm.job.config import JobConfig
from swarm.policy.wiring import NoReplicaError, Wiring
from swarm.proto import stage_pb2 as pb
from swarm.rpc.stage_client import Retiring, StageClient, TensorLike, named

__all__ = ["Downstream", "Pushed"]

log = logging.getLogger(__name__)


@dataclass
class Pushed:
    """What came back from the stages after this one."""

    grad: TensorLike | None  # the gradient of this stage's outputs (when asked for)
    receipts: list[pb.Receipt] = field(default_factory=list)
    uncertain: set[int] = field(default_factory=set)
    loss_sum: float = 0.0


class Downstream:
    """The stages after `stage` as this replica sees them: a pool per stage and a client per
    replica, both following the routes requests carry."""

    def __init__(
        self, job: JobConfig, job_id: str, stage: int, token: str | None, attempts: int = 4
    ) -> None:
        self.job, self.job_id, self.stage, self.token = job, job_id, stage, token
        self.attempts = attempts
        self.wiring = Wiring(
            job.training.stages,
            clock=MonotonicClock(),
            rng=random.Random(),
            task_samples=job.training.microbatch_size,
        )
        self._clients: dict[str, StageClient] = {}  # peer -> the client of its address
        self._retiring = Retiring(job.runtime.rpc_timeout_s)

    def follow(self, stage: int, route: pb.Route) -> None:
        """Make `stage`'s pool the replicas `route` names (a request's view of the members)."""
        pool = self.wiring[stage]
        addresses = dict(zip(route.peers, route.addresses, strict=False))
        for gone in [p for p in pool if p not in addresses]:
            self.wiring.remove(gone)
            self._retiring.retire(self._clients.pop(gone, None))
        for i, (peer, address) in enumerate(addresses.items()):
            client = self._clients.get(peer)
            if client is not None and (client.address, client.stage) != (address, stage):
                self._retiring.retire(self._clients.pop(peer))
                client = None
            if client is None:
                self._clients[peer] = StageClient(address, self.job, self.job_id, stage, self.token)
            if peer not in pool:
                speed = route.throughput[i] if i < len(route.throughput) else 0.0
                self.wiring.add(peer, stage, speed if speed > 0 else 1.0)

    async def push(
        self,
        step: int,
        index: int,
        outputs: torch.Tensor,
        targets: torch.Tensor,
        accumulate: list[int],
        route: list[pb.Route],
        *,
        need_grad: bool,
        deadline: float,
        evaluate: bool = False,
    ) -> Pushed:
        """Send `outputs` on to the next stage (tries on others as above); raises
        `PeerUnavailable` when no replica of it gave what this replica needs (`evaluate`: a
        validation microbatch, whose loss it needs)."""
        stage = self.stage + 1
        if not route:
            raise PeerUnavailable(f"stage {stage}: the request named no replica of it")
        self.follow(stage, route[0])
        pool, samples = self.wiring[stage], self.job.training.microbatch_size
        uncertain: set[int] = set()
        last: BaseException | None = None
        for _ in range(self.attempts):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                peer = pool.choose(samples)
            except NoReplicaError as e:
                last = e
                break
            pool.started(peer, samples)
            start = time.perf_counter()
            try:
                result = await self._clients[peer].push(
                    step,
                    index,
                    outputs,
                    targets,
                    accumulate,
                    route[1:],
                    need_grad_inputs=need_grad,
                    timeout=left,
                    evaluate=evaluate,
                )
            except Busy as e:  # its queue is full: not its fault, try another
                pool.busy(peer, samples)
                last = e
                continue
            except SwarmError as e:
                pool.failed(peer, samples)
                last = e
                if accumulate:  # it may have accumulated before failing: never again from here
                    log.info(
                        "push to stage %d: %s failed (%r); its stages %s are uncertain",
                        stage,
                        peer,
                        e,
                        accumulate,
                    )
                    uncertain.update(accumulate)
                    accumulate = []
                if not (need_grad or evaluate):
                    return Pushed(None, [], uncertain)
                continue
            queued = result.queued_seconds
            pool.finished(peer, samples, max(1e-6, time.perf_counter() - start - queued))
            return Pushed(
                result.grad_inputs,
                named(result.receipts, stage, peer),
                uncertain | set(result.uncertain),
                result.loss_sum,
            )
        raise PeerUnavailable(f"stage {stage}: no replica took the microbatch: {last}")

    async def close(self) -> None:
        await self._retiring.close()
        await asyncio.gather(*(c.close() for c in self._clients.values()))
        self._clients.clear()
