"""How a stage's state moves into and out of a replica, as the pool and the coordinator ask: a
member serves a snapshot of its state (DownloadState) and the updates it applied since
(Updates) to a replica copying it; a joining replica answers the coordinator's Join with how far
its copy of a member has come (the copy itself runs in `stage_server.replica.copying`); LoadState
installs a state the coordinator sends (a rollback to a checkpoint).

Invariants, and why:
- A snapshot and the update log are read on the replica's worker, between updates: the state is
  of one step, and a follower registered there misses no update after it.
- A joining replica becomes a member only at a step its copy has reached: Join answers -1 until
  the copy is loaded and following, and the coordinator never takes -1 for a member's step.
- One copy at a time, of the source the coordinator names: another source, a new assignment or a
  rollback cancels the running one; a failed one is started again by the next Join.
- A state to load is bounded before it is held: at most what the stage's state can take, every
  tensor one of the stage's, each message routed from its header and its body within the
  process's receive budget, so a sender cannot size this process's memory.
- A state to serve is a snapshot of one step streamed as it is sent
  (`stage_server.replica.snapshot`: the replica's own tensors, copied only if an update comes before
  they are sent), at most `--max-state-downloads` at once: a request of a few bytes may cost a copy
  of the state, so their number is bounded, and nothing more is built ahead of the reader. A
  download whose reader took nothing for `rpc_timeout_s` (its client gave up) ends, its place and
  its snapshot let go; so does an answer of updates, and the updates it holds.
- Info says the rollback epoch of the state a replica holds, set only with the state: a
  rollback's LoadState, or a loaded copy (the epoch of the Join that began it; a copy from
  before a rollback fails at its next ask, its source's update log cleared). A Join raises only
  the epoch whose older work the replica refuses.
- A follower's place in the update log is held by a copy that goes on: a download that ends
  before its state is sent lets its follower go (`stage_server.replica.update_log`).
- Only the coordinator names followers: under a scheduler (its key known), a download or an ask
  for updates that names a follower is refused, before anything is read or kept, unless it
  brings the scheduler's ticket naming that follower and this replica
  (`swarm.net.follow_tickets`); the joiner got it with its signed Join. A download that names
  no follower registers nothing and needs none.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch

from stage_server.averaging.staging import OffLoop
from stage_server.peer.links import payload_bytes
from stage_server.peer.metrics import StageMetrics
from stage_server.replica.copying import Copy
from stage_server.replica.download_places import DownloadPlaces
from stage_server.replica.messages import Limits, Route, state_reply, updates_reply
from stage_server.replica.runtime import Served
from stage_server.replica.snapshot import Snapshot
from stage_server.replica.update_log import UpdateLog
from stage_server.replica.worker import Worker
from swarm.deadline import within
from swarm.errors import FailedPrecondition, InvalidArgument, PermissionDenied, ResourceExhausted
from swarm.net.commit_auth import state_digest
from swarm.net.follow_tickets import FollowTickets
from swarm.ops.faults import Point, maybe_die
from swarm.proto import stage_pb2 as pb
from swarm.rpc.reader_idle import taken_within
from swarm.rpc.stage_client import StageClient
from swarm.rpc.state_streams import whole_state_s
from swarm.wire import chunking as wire
from swarm.wire.budget import ReceiveBudget

__all__ = ["StateTransfer"]

log = logging.getLogger(__name__)


class StateTransfer:
    """The state transfers of one replica, of the stage `runtime()` serves (read where each
    transfer starts, and again before a received state is loaded), and the background copy it may
    be running."""

    LONG_POLL_S = 0.5  # an ask for updates with none new waits this long for the next one

    def __init__(
        self,
        *,
        peer: str,
        token: str | None,
        worker: Worker,
        metrics: StageMetrics,
        runtime: Served,
        budget: ReceiveBudget,
        limits: Limits,
        scheduler_key: Callable[[], bytes | None] = lambda: None,
    ) -> None:
        """`scheduler_key()`: the key of the scheduler that placed this replica (None: none
        did), whose tickets name its followers."""
        self.peer, self.token, self._worker, self.metrics = peer, token, worker, metrics
        self._runtime, self._budget, self._limits = runtime, budget, limits
        self._scheduler_key = scheduler_key
        self._tickets: FollowTickets | None = None  # of the scheduler key last seen
        self.copy: Copy | None = None  # a joining replica's background copy of a member
        self.places = DownloadPlaces(peer)  # of `--max-state-downloads`

    def _named(self, job_id: str, follower: str, ticket: bytes, *, fresh: bool) -> None:
        """PermissionDenied unless `follower` is one the scheduler named, by `ticket` (fresh:
        for a new registration), when a scheduler placed this replica; anyone, else."""
        key = self._scheduler_key()
        if key is None:
            return  # its owner coordinates it (`swarm trainer --stage-servers`): the token
        if self._tickets is None or self._tickets.public != key:
            self._tickets = FollowTickets(key, self.peer)
        self._tickets.check(job_id, self._runtime().stage, follower, ticket, fresh=fresh)

    def stop_copy(self) -> None:
        if self.copy is not None:
            self.copy.task.cancel()
            self.copy = None

    async def join(
        self, job_id: str, source: str, step: int, ticket: bytes = b"", epoch: int = 0
    ) -> int:
        """The coordinator asks this replica to join at `step` from the member at `source`: the
        step this replica is at as a copy of `source` (-1: nothing copied yet). Starts a copy
        when none of `source` is running, presenting `ticket` (the scheduler's, naming this
        replica a follower of `source`) to it. `epoch`: the coordinator's rollback epoch."""
        rt, copy = self._runtime(), self.copy
        if epoch < rt.sums.epoch:
            # Sent before a rollback whose LoadState this replica has had: its source may still
            # hold the trajectory rolled back, which a copy would install over the rollback's
            # state. The coordinator's next Join carries the rollback's epoch.
            raise FailedPrecondition(
                f"stage {rt.stage}: a Join sent before the rollback of epoch {rt.sums.epoch} "
                f"(it names epoch {epoch}): stale, no copy started"
            )
        # Before the answer that makes this replica a member: one that joins after a rollback
        # got no LoadState of it, and refuses work leased before it as those that loaded it do.
        rt.sums.retire_before(epoch)
        if copy is not None and copy.address == source and copy.running:
            if copy.loaded and rt.following and rt.copy_step < step:
                # The update it lacks was just applied at the source: fetch it now.
                await copy.reach(step, rt.job.runtime.rpc_timeout_s / 4)
            if copy.loaded and rt.following and rt.copy_step == step:
                log.info(
                    "%s: joined stage %d at step %d from %s", self.peer, rt.stage, rt.step, source
                )
                self.metrics.committed(rt.step, applied=False)
            return rt.copy_step if copy.loaded and rt.following else -1
        failed = copy.error if copy is not None and copy.address == source else None
        if failed is not None:
            log.info("%s: copying %s again after: %s", self.peer, source, failed)
        # Not copying `source` (a first ask, another source, a copy that failed or ended): start
        # one; the answer is where this replica is now, which the coordinator does not take for
        # a member's step.
        self.stop_copy()
        log.info(
            "%s: copying stage %d from %s to join at step %d", self.peer, rt.stage, source, step
        )
        # The member's answers are bounded by the job within this peer's limits.
        client = StageClient(source, self._limits.clamp(rt.job), job_id, rt.stage, self.token)
        self.copy = Copy(client, rt, self._worker.run, self.peer, ticket, self._copied, epoch)
        if failed is not None and not isinstance(failed, ResourceExhausted):
            # Begun again, and said: answered -1, the coordinator's status would say the
            # joiner downloads, while each copy fails (a source refusing it, a state too large).
            # Not a source busy serving others (its places taken): that is no failure of this
            # copy, and a standby's asks that fail are counted toward its replacement.
            raise FailedPrecondition(
                f"its copy of {source} failed ({str(failed)[:300]}); copying it again"
            )
        return -1

    def _copied(self, nbytes: int, seconds: float) -> None:
        self.metrics.moved("down", nbytes, seconds)  # a state downloaded: this link's rate

    async def updates(
        self, job_id: str, follower: str, ticket: bytes, from_step: int, chunk_bytes: int
    ) -> AsyncIterator[pb.StageUpdatesResponse]:
        """The Updates answer: the updates `follower` (named by `ticket`, under a scheduler)
        lacks from `from_step` on (read between updates, on the worker: the log and the step
        move together there), streamed as sent."""
        # Another caller naming a real follower must not move or end its registration.
        self._named(job_id, follower, ticket, fresh=False)
        log_ = self._runtime().updates
        # A long poll: with nothing new, the answer waits (at most `LONG_POLL_S`) for the next
        # update kept, so a follower has each step's update as this replica applies it, not at
        # its next ask (a standby a step behind when its stage dies costs the job a rollback).
        loop, kept = asyncio.get_running_loop(), asyncio.Event()

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                loop.call_soon_threadsafe(kept.set)

        log_.watch(wake)  # before the read: an update kept between the two is not missed
        try:
            updates = await self._worker.run(log_.since, follower, from_step)
            if not updates and from_step >= 0:
                with contextlib.suppress(TimeoutError):
                    await within(kept.wait(), self.LONG_POLL_S)
                updates = await self._worker.run(log_.since, follower, from_step)
        finally:
            log_.unwatch(wake)
        # On the uplink's waiting lane: between the boundary's sends, which the step waits for
        # (`stage_server.peer.uplink`), in parts small enough not to hold one up.
        lane = self.metrics.uplink.waiting(follower)
        # A reader that takes nothing for `rpc_timeout_s` (after which its own client gives up)
        # is let go: its call would hold these updates, each a stage's gradient, for as long as
        # its connection lived, after the log itself let them go.
        stall_s = self._runtime().job.runtime.rpc_timeout_s
        said = f"{self.peer}: the updates of follower {follower}"
        for part in updates_reply(updates, lane.part_bytes(chunk_bytes)):
            await lane.before()
            handed = loop.time()
            with taken_within(stall_s, said):
                yield part
            lane.sent(payload_bytes(part), loop.time() - handed)
            log_.touch(follower)  # still reading: not silent
        lane.done()

    async def download(
        self, job_id: str, follower: str, ticket: bytes, include_optimizer: bool, chunk_bytes: int
    ) -> AsyncIterator[pb.StageDownloadStateResponse]:
        """The DownloadState answer: a `snapshot`, streamed chunk by chunk as it is sent.
        PermissionDenied for a `follower` the scheduler's `ticket` does not name (under a
        scheduler: issue 44, N7); ResourceExhausted when `--max-state-downloads` are being
        served already."""
        if follower:
            self._named(job_id, follower, ticket, fresh=True)
        rt, most = self._runtime(), self._limits.peer.max_state_downloads
        stall_s = rt.job.runtime.rpc_timeout_s
        self.places.make_room(most, follower, stall_s, whole_state_s(rt.max_state_bytes()))
        if len(self.places) >= most:
            raise ResourceExhausted(
                f"{len(self.places)} state downloads are being served already, the most this "
                f"peer serves at once (--max-state-downloads): try again later"
            )
        task, loop = asyncio.current_task(), asyncio.get_running_loop()
        assert task is not None  # a call's handler
        self.places.taken(task, named=bool(follower))
        said = f"{self.peer}: a state download of {follower or 'a caller'}"
        log_, registered, sent = self._runtime().updates, None, False
        off: OffLoop | None = None
        try:
            snapshot, registered = await self.snapshot(follower, include_optimizer)
            self.places.heard(task)
            # A device's chunks are copied to the host (under the snapshot's lock) off the loop.
            off = OffLoop(snapshot.on_device, snapshot.device)
            # A joiner's or a standby's copy (or a checkpoint's) taken mid-job waits, part by
            # part, for the boundary's claims on the uplink to be through (at most `HOLD_S` in
            # all), as an update does: the step waits for those sends. Unlike an update it is
            # not paced, nor cut to the lane's parts: its time stays the link's (the meter's
            # sample below), a slow reader (a checkpoint's) teaches the lane no rate, and its
            # chunks keep the one size whose pinned staging buffers a device's download reuses.
            lane = self.metrics.uplink.waiting(follower)
            parts = state_reply(snapshot, chunk_bytes)
            started, nbytes = loop.time(), 0  # its bytes over its time: this link's upload
            while (part := await off.next(parts)) is not None:
                await lane.before()
                # Its reader's own client waits `rpc_timeout_s` for a part: one that stops
                # reading holds its snapshot (a copy of the state once an update comes) no
                # longer, whether or not another download wants its place.
                with taken_within(stall_s, said):
                    yield part
                nbytes += payload_bytes(part)
                if (why := self.places.ending(task)) is not None:
                    raise ResourceExhausted(
                        f"{self.peer} ended this state download for another: {why} "
                        "(--max-state-downloads are served at once)"
                    )
                self.places.heard(task)  # its reader took a part
                if follower:
                    log_.touch(follower)  # its download goes on: not silent
            sent = True
            if not lane.waited:  # a held answer's time is partly the lane's, not the link's
                self.metrics.moved("up", nbytes, loop.time() - started)
        finally:
            if off is not None:
                off.shutdown()  # its thread ends with its last copy (nothing waits on it)
            self.places.left(task)
            # A follower's place is held by a copy that goes on: one whose download ended
            # early (a caller that named itself a follower and hung up) has none (N7).
            if registered is not None:
                (log_.sent if sent else log_.unfollow)(follower, registered)

    async def snapshot(self, follower: str, include_optimizer: bool) -> tuple[Snapshot, int | None]:
        """This replica's state of its step, taken between updates so it is of one step (and
        kept so: `stage_server.replica.snapshot`). A `follower` (a joining peer) has the updates
        after it kept for it: its registration in the update log comes with the snapshot."""
        rt = self._runtime()

        def take() -> tuple[Snapshot, int | None]:
            registered = rt.updates.follow(follower, rt.step) if follower else None
            return rt.snapshot(include_optimizer), registered

        taking = asyncio.ensure_future(self._worker.run(take))
        try:
            snapshot, registered = await asyncio.shield(taking)
        except asyncio.CancelledError:
            # The caller hung up while the snapshot waited for the worker, which takes it
            # anyway: its follower goes once it is registered.
            taking.add_done_callback(lambda done: _unfollow(rt.updates, follower, done))
            raise
        maybe_die(Point.STATE_DOWNLOAD, snapshot.step)
        return snapshot, registered

    async def load(
        self,
        requests: AsyncIterator[Any],
        route: Route,
        limits: Limits,
        signed_digest: bytes | None = None,
    ) -> int:
        """Receive a LoadState stream (each message within `limits`, each routed by `route`) and
        become the replica whose state it holds (a rollback); the state's step. With
        `signed_digest` (the scheduler's signature covers it), a state of another digest is
        refused before it is loaded: the signature covers the state, not only the call."""
        step, state, epoch = await self._receive(requests, route, limits)
        if signed_digest is not None and (
            await asyncio.to_thread(state_digest, step, state) != signed_digest
        ):
            raise PermissionDenied(
                "LoadState: the state sent is not the one the scheduler signed (its digest "
                "differs): not loaded"
            )
        self.stop_copy()  # a copy of the state before it is moot
        # On the loop, before the worker loads: a Join sent before this rollback and handled
        # while the state loads is refused as stale (`join`), not let in between the two.
        self._runtime().sums.retire_before(epoch)
        await self._worker.run(self._loaded, step, state, epoch)
        log.warning(
            "%s: loaded stage %d's state of step %d (a rollback)",
            self.peer,
            self._runtime().stage,
            step,
        )
        self.metrics.committed(step, applied=False)
        return step

    def _loaded(self, step: int, state: dict[str, torch.Tensor], epoch: int) -> None:
        """On the worker, between two calls' work: the state, and the rollback's epoch with it
        (work leased before the rollback is refused from now on: `swarm.rpc.epoch`)."""
        rt = self._runtime()
        rt.load_state(step, state)
        rt.sums.rolled_back(epoch)

    async def _receive(
        self, requests: AsyncIterator[Any], route: Route, limits: Limits
    ) -> tuple[int, dict[str, torch.Tensor], int]:
        """The whole state is at most what this stage's can take, and every tensor must be one
        of the stage's: bytes beyond either are refused, not held until memory runs out."""
        stream, state, step = requests.__aiter__(), {}, -1
        rt = self._runtime()
        budget = rt.max_state_bytes()

        epoch = 0

        def check(header: Any) -> None:
            nonlocal epoch
            route(header.job, header.stage)
            epoch = max(epoch, header.epoch)

        while True:
            limit = min(limits.max_bytes, budget)
            # One message's body at a time from the process's budget: the state it builds is
            # bounded by the stage's own size (`budget`), not by the receive budget.
            bound_by = (
                limits.max_bytes_name
                if limit == limits.max_bytes
                else f"stage {rt.stage}'s state takes at most {rt.max_state_bytes()} bytes, of "
                f"which {rt.max_state_bytes() - budget} were sent already"
            )
            with self._budget.hold() as held:
                try:
                    received = await wire.receive(
                        stream,
                        max_bytes=limit,
                        admit=check,
                        reserve=held.reserve,
                        limit_name=bound_by,
                    )
                except wire.EndOfStream:
                    break
                step = received.header.step
                tensors = await wire.decode_named_async(  # lossy values widened off the loop
                    received, max_bytes=limit, reserve=held.reserve, owned=True
                )
                budget -= sum(t.nbytes for t in tensors.values())
                for name, tensor in tensors.items():
                    rt.checks.state_tensor(name, tensor)
                    state[name] = tensor  # its own buffer: no copy
        if step < 0:
            raise InvalidArgument("LoadState carried no state")
        return step, state, epoch


def _unfollow(
    log_: UpdateLog, follower: str, taken: asyncio.Future[tuple[Any, int | None]]
) -> None:
    """The follower `taken` (a snapshot no one waits for any more) registered, let go."""
    if taken.cancelled() or taken.exception() is not None:
        return
    registered = taken.result()[1]
    if registered is not None:
        log_.unfollow(follower, registered)
