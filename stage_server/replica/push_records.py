"""The push plane's records (issue 55): what this replica received and sent for each microbatch it
pushed on, kept so its work can be audited by re-execution.

On the push plane the trainer holds no boundary: each replica sends its outputs straight to the
next stage and its input gradient straight back. So each replica commits to what it did itself:
for every microbatch, the digest (`swarm.wire.digest`) of the activations and token ids it
received, of the outputs it sent on (the last stage: its loss sum), of the gradient of its outputs
it received (the last stage: the targets) and of the input gradient it sent back. The trainer
asks every replica of the microbatch's path for its commitment (`Record`, the commitment only)
before it draws which stages to audit, and the replicas on either side of each boundary must
agree about the bytes that crossed it; a stage drawn is then asked for the record itself, whose
tensors must match what it committed to, and another replica re-executes from them.

Each tensor is kept as it crossed the boundary, and `Record` answers it so: a received one as it
came (`Arrived`, its payload as received, never widened: a `hadamard3` boundary's 3 bits a value,
not float32's 32), a sent one as it was sent. A record then costs the trainer's link what the
boundary cost, and the payload decodes bitwise to the tensor computed on and committed to
(decoding is deterministic), so the trainer's digest checks and its re-executions stay exact. It
is kept instead of the decoded tensor, which the compute path lets go of when the push is done
(an uncompressed one shares the payload's memory: no more than before either way).

How long: the last `activation_cache` microbatches (the job's, within this peer's limit), the
oldest dropped first; the trainer asks right after the microbatch's push returns. Each run of a
microbatch (the trainer's random id of it, passed on along the path) has a record of its own, so
a replay or a straggler of the same microbatch is never taken for the run audited. Nothing is
kept where the job audits nothing.

The digests are taken on a thread of their own (`PushRecords`' `digester`), beside the stage's
compute and off the event loop that relays other pushes (issue 69: on the loop they were the
audits' largest cost); a push waits for its record's (`PushRecord.settled`) before it answers,
so the tensors they read are still what came and went, and a commitment is whole when asked."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Protocol

import torch

from swarm.deadline import settled
from swarm.errors import ActivationsNotCached, Busy
from swarm.proto import stage_pb2 as pb
from swarm.proto import tensor_pb2
from swarm.wire import codec
from swarm.wire.digest import digest

__all__ = [
    "NO_RECORD",
    "TAKEN_KEPT",
    "Arrived",
    "NoRecord",
    "PushRecord",
    "PushRecords",
    "Recording",
]

#: The runs a replica remembers taking a push of (about 100 bytes each): past its records'
#: count, so that pushes of runs of one's own do not make it forget an honest run's.
TAKEN_KEPT = 1 << 16


Payload = bytes | memoryview | torch.Tensor  # as `swarm.wire.chunking.Received` holds one


@dataclass(frozen=True)
class Arrived:
    """A tensor as it crossed the boundary: its message's header without the bytes (`meta`) and
    the bytes (`payload`), in the encoding that crossed it. One that came in: as received (a
    message's own, a chunked stream's buffer, or a handed-over tensor's `swarm.device.handover`
    copy). One that went out handed over (outputs offered, a gradient written into the caller's
    slot): the payload handed over, on the host, so no message is made for the record alone
    (issue 69: its copies were the record's price on every hop). Decoding is deterministic:
    they decode to the very tensor the replica computed on, or its receiver decoded."""

    meta: tensor_pb2.Tensor
    payload: Payload

    @classmethod
    def of(cls, t: tensor_pb2.Tensor, payload: Payload) -> Arrived:
        """`t` (a request's header entry) received with `payload`."""
        meta = tensor_pb2.Tensor(
            name=t.name, dtype=t.dtype, shape=t.shape, codec=t.codec, block_size=t.block_size
        )
        return cls(meta, payload)

    def decoded(self) -> torch.Tensor:
        """The tensor its receiver decodes (a payload on the host: no copy where no codec)."""
        return codec.decode(self.meta, self.payload)

    def message(self) -> tensor_pb2.Tensor:
        """The message as it came (on the wire; a handed-over one's bytes put in it)."""
        msg = tensor_pb2.Tensor()
        msg.CopyFrom(self.meta)
        p = self.payload
        msg.data = (
            p.reshape(-1).cpu().numpy().tobytes() if isinstance(p, torch.Tensor) else bytes(p)
        )
        msg.nbytes = len(msg.data)
        return msg


Kept = torch.Tensor | tensor_pb2.Tensor | Arrived
Sent = tensor_pb2.Tensor | Arrived | torch.Tensor | None  # a message, bytes handed over, a loss


class Recording(Protocol):
    """What the push plane tells of one microbatch as it runs: kept where its run is audited
    (`PushRecord`), nothing where it is not (`NO_RECORD`). The plane tells it the same either
    way; what a record costs (digests, the tensors kept) is paid only by a record."""

    #: a record is kept (what it commits to is digested, and its tensors kept)
    kept: bool

    def received(
        self,
        name: str,
        tensor: torch.Tensor | None,
        came: Arrived | tensor_pb2.Tensor | None = None,
    ) -> None:
        """`tensor` came in as `name`, decoded from `came` (None: decoded already)."""
        ...

    def sent(self, name: str, made: Callable[[], Sent]) -> None:
        """What went out as `name`, made by `made` only where it is kept (its bytes can cost a
        copy from the device): committed to as its receiver decodes it."""
        ...

    async def settled(self) -> None:
        """Every digest taken (the tensors they read may go once it returns)."""
        ...

    def backward_begins(self) -> None:
        """Its push's backward goes to the worker now: whatever happens after, it may
        accumulate, and the record stays (`PushRecords.drop`)."""
        ...


class NoRecord:
    """The null `Recording`: a run nobody audits (`run` 0, or a job that audits nothing)."""

    kept = False

    def received(
        self,
        name: str,
        tensor: torch.Tensor | None,
        came: Arrived | tensor_pb2.Tensor | None = None,
    ) -> None:
        pass

    def sent(self, name: str, made: Callable[[], Sent]) -> None:
        pass

    async def settled(self) -> None:
        pass

    def backward_begins(self) -> None:
        pass


NO_RECORD = NoRecord()


@dataclass
class PushRecord:
    """One microbatch at this replica: the tensors (as they came in, or the messages sent) and
    the commitment made of their digests (taken on `digester`, or at once where it is None)."""

    _commitment: pb.Commitment
    tensors: dict[str, Kept] = field(default_factory=dict)
    kept = True
    backward_began = False  # its push's backward was given the worker (`PushRecords.drop`)
    digester: Executor | None = None
    _pending: dict[str, Future[bytes]] = field(default_factory=dict)

    def backward_begins(self) -> None:
        self.backward_began = True

    @property
    def key(self) -> tuple[int, int, int]:
        """The run it records: (step, index, run)."""
        c = self._commitment
        return c.microbatch.step, c.microbatch.index, c.run

    @property
    def commitment(self) -> pb.Commitment:
        """The commitment, its digests all in (waiting for any still being taken: a push
        `settled` its own before it answered, so `Record` finds them done)."""
        for name, taken in list(self._pending.items()):  # the worker may add one meanwhile
            setattr(self._commitment, name, taken.result())
            self._pending.pop(name, None)
        return self._commitment

    async def settled(self) -> None:
        """Every digest taken: the tensors they read may go. A caller cancelled meanwhile (its
        caller hung up) still waits for them, then is cancelled: a cancelled gather cancelled
        the queued digests and left the running one reading tensors its push let go."""
        pending = [asyncio.wrap_future(f) for f in self._pending.values()]
        if pending:
            await settled(*pending)
            await asyncio.gather(*pending)  # a digest's failure, as before

    def _commit(self, name: str, take: Callable[[], bytes]) -> None:
        """Commit `name` to the digest `take` computes: on the digester, or here and now."""
        self._pending.pop(name, None)
        if self.digester is None:
            setattr(self._commitment, name, take())
        else:
            self._pending[name] = self.digester.submit(take)

    def received(
        self,
        name: str,
        tensor: torch.Tensor | None,
        came: Arrived | tensor_pb2.Tensor | None = None,
    ) -> None:
        """`tensor` came in as `name` ("inputs", "grad_outputs", "tokens", "targets"), decoded
        from `came` (kept instead of `tensor`: what crossed the boundary, as it crossed; None:
        it came into a slot, decoded already, or it came from nowhere, the first stage's)."""
        if tensor is not None:
            self.tensors[name] = tensor if came is None else came
            self._commit(name, lambda: digest(tensor))

    def sent(self, name: str, made: Callable[[], Sent]) -> None:
        """What `made` makes went out as `name` ("outputs", "grad_inputs"; a liar's: what it
        says it sent), committed to as its receiver decodes it (a loss: itself)."""
        msg = made()
        if msg is not None:
            self.tensors[name] = msg
            if isinstance(msg, torch.Tensor):
                self._commit(name, lambda: digest(msg))
            elif isinstance(msg, Arrived):
                self._commit(name, lambda: digest(msg.decoded()))
            else:
                self._commit(name, lambda: sent_digest(msg))

    def messages(self, asked: bool = True) -> list[tensor_pb2.Tensor]:
        """The record's tensors (none unless `asked`), as `Record` answers them: each message as
        it came or went, so a record costs the trainer's link what the boundary cost; a tensor
        held decoded (a loss, one that came into a slot) encoded without loss."""
        out = []
        for name, t in self.tensors.items() if asked else ():
            if isinstance(t, torch.Tensor):
                msg = codec.encode(t, name)
            elif isinstance(t, Arrived):
                msg = t.message()
            else:
                msg = tensor_pb2.Tensor()
                msg.CopyFrom(t)
            msg.name = name
            out.append(msg)
        return out


def sent_digest(msg: tensor_pb2.Tensor | None) -> bytes:
    """The digest of a message as its receiver decodes it."""
    return b"" if msg is None else digest(codec.decode(msg))


class PushRecords:
    """The records of the last `limit()` microbatches this replica pushed on, and the runs it
    took a push of (the last `TAKEN_KEPT`): a run is taken once here."""

    def __init__(
        self, peer: str, limit: Callable[[], int], digester: Executor | None = None
    ) -> None:
        """`digester`: where the records' digests are taken (None: at once, by their caller)."""
        self.peer, self.limit, self.digester = peer, limit, digester
        self._records: OrderedDict[tuple[int, int, int], PushRecord] = OrderedDict()
        # Kept past its record: an evicted record's run pushed again (any token holder can
        # push runs of its own until the honest record goes) is still turned away.
        self._taken: OrderedDict[tuple[int, int, int], None] = OrderedDict()

    def check(self, step: int, index: int, run: int) -> None:
        """Busy where this replica took a push of run `run` of microbatch `(step, index)`
        already. A member of the run's path knows its id: a second push of it here, with other
        inputs, would put in place of what this replica accumulated a record the trainer then
        audits it by. Asked from a push's header, before its body is read (a co-located
        sender's handover then stays its own), and again as its record begins. An honest retry
        whose try failed here before its backward left nothing (`drop`); one whose try got
        further goes on to another replica."""
        if (step, index, run) in self._taken:
            raise Busy(
                f"{self.peer}: a push of run {run} of microbatch ({step}, {index}) came here "
                "already; a run is taken once a replica: try another"
            )

    def begin(self, stage: int, step: int, index: int, run: int) -> PushRecord:
        """A new record for run `run` of microbatch `(step, index)` at `stage` (`check`ed)."""
        self.check(step, index, run)
        key = (step, index, run)
        self._taken[key] = None
        while len(self._taken) > TAKEN_KEPT:
            self._taken.popitem(last=False)
        mb = pb.MicrobatchId(step=step, index=index)
        commitment = pb.Commitment(peer=self.peer, stage=stage, microbatch=mb, run=run)
        record = PushRecord(commitment, digester=self.digester)
        self._records[key] = record
        while len(self._records) > max(1, self.limit()):
            self._records.popitem(last=False)
        return record

    def drop(self, record: Recording) -> None:
        """`record`'s push failed: it goes, and its run may come again (its retry here makes
        its own), unless its backward began here: what the backward added to the step is the
        record's, and stays with it (a caller that hung up then does not end the backward on
        the worker). A record of the same run begun since is another's, and stays."""
        if not isinstance(record, PushRecord) or record.backward_began:
            return  # NO_RECORD: nothing was kept
        if self._records.get(record.key) is record:
            del self._records[record.key]
            self._taken.pop(record.key, None)

    def get(self, step: int, index: int, run: int) -> PushRecord:
        record = self._records.get((step, index, run))
        if record is None:
            raise ActivationsNotCached(
                f"{self.peer}: no record of run {run} of microbatch ({step}, {index})"
            )
        return record

    def answer(self, h: pb.StageRecordRequest) -> pb.StageRecordResponse:
        """`Record`'s answer to `h`: the commitment, and the tensors if asked."""
        r = self.get(h.microbatch.step, h.microbatch.index, h.run)
        return pb.StageRecordResponse(commitment=r.commitment, tensors=r.messages(h.tensors_too))

    async def answered(self, h: pb.StageRecordRequest) -> pb.StageRecordResponse:
        """`answer`, as the event loop asks it: the record's digests waited for here (a run
        whose push is in flight may be asked for: they may be on the digester still), and the
        tensors' copies made off the loop."""
        await self.get(h.microbatch.step, h.microbatch.index, h.run).settled()
        return await asyncio.to_thread(self.answer, h)

    def clear(self) -> None:
        self._records.clear()
