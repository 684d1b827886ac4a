"""How large a replica's answer to the coordinator's unary calls (Commit, Discard, Join, Info) may
be, and what its repeated fields may count, checked where the stage client takes it.

Why: those answers came on the data channel, sized for a microbatch's tensors (the job's
`max_message_bytes`, 64 MiB by default), and were parsed whole on the scheduler's event loop,
which the embedded broker and every job's calls share; then their lists were copied and scanned,
some once per pair of contributors. Any token holder's stage server announcing itself serving is
asked for its Info; one answering 64 MiB of receipts, or a PREPARE with millions of empty sum
checks, held the loop for seconds and filled the memory with small objects. An honest answer
is kilobytes: its receipts at most the step's microbatches, its layers the job's, a sum check
per part of the round and per audit seed, each listing at most the round's contributors. So the
calls go on a channel of their own that takes at most `control_reply_bytes` (a quarter of the
data channel's by default, lazily opened: a trainer makes none of these calls), and an answer
past its counts is the replica's `BadReply`, before any of it is used."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from swarm.errors import BadReply
from swarm.job.config import JobConfig
from swarm.proto import stage_pb2 as pb

__all__ = ["CONTROL_CALLS", "SplitStub", "check_commit", "check_info", "control_reply_bytes"]

# The fixed fields and a round's sum checks: an audited round of G replicas answers G x (G - 1)
# checks of about 80 bytes and its own part's lists (1.25 MB at G = 128); 16 MiB holds G of
# about 380. Nothing caps the replicas of a stage, so past that a round's answers are refused
# (the counts still bound the work after the parse: the channel's bound is the parse's).
BASE_BYTES = 16 << 20
PER_INDEX_BYTES = 16  # a receipt (an int64 varint and its tag) or a layer, with room


CONTROL_CALLS = frozenset({"Commit", "Discard", "Join", "Info"})


class SplitStub:
    """A `StageServiceStub` whose `CONTROL_CALLS` go on the control channel's stub (`control()`,
    made at the first) and every other call on the data channel's. One stub still: whatever
    wraps a stage client's stub (the scheduler's signatures, `swarm.net.commit_auth`) wraps both."""

    def __init__(self, data: Any, control: Callable[[], Any]) -> None:
        self._data, self._control = data, control

    def __getattr__(self, name: str) -> Any:
        return getattr(self._control() if name in CONTROL_CALLS else self._data, name)


def control_reply_bytes(job: JobConfig) -> int:
    """The largest unary answer a replica of `job` may send the coordinator: never more than the
    job's own message bound."""
    # the receipts of two steps and the run of each, the calls in flight of two steps (each a
    # step, an index and a run: about two indices' bytes), and the layers
    indices = 8 * job.training.microbatches_per_step + job.model.n_layers
    return min(BASE_BYTES + PER_INDEX_BYTES * indices, job.runtime.max_message_bytes)


def check_info(response: pb.StageInfoResponse, job: JobConfig) -> None:
    """Refuse an Info answer listing more receipts (or runs of them) than a step has
    microbatches, more calls in flight than two steps have, or more layers than the job has."""
    most = job.training.microbatches_per_step
    for name, count, bound in (
        ("receipts", len(response.receipts), most),
        ("calls in flight", len(response.in_flight), 2 * most),
        ("next_receipts", len(response.next_receipts), most),
        ("receipt_runs", len(response.receipt_runs), most),
        ("next_receipt_runs", len(response.next_receipt_runs), most),
        ("layers", len(response.layers), job.model.n_layers + 2),  # the embedding, the head
    ):
        if count > bound:
            raise BadReply(f"its Info lists {count} {name}, past the job's {bound}")


def check_commit(response: pb.StageCommitResponse, request: pb.StageCommitRequest) -> None:
    """Refuse a Commit answer with more sum checks than the round has parts (one per part it
        averaged, and again per audit seed), or a check listing more senders than the round has
    members."""
    parts = max(len(request.group), 1)  # its members own the parts; contributors are of them
    for name, checks, bound in (
        ("sum checks", response.sum_checks, parts),
        ("audit checks", response.audit_checks, parts * len(request.audit_seeds)),
    ):
        if len(checks) > bound:
            raise BadReply(
                f"its Commit answer holds {len(checks)} {name}, past the round's {bound}"
            )
        for check in checks:
            most = max(
                len(check.received), len(check.received_dots), len(check.received_magnitudes)
            )
            if most > parts:
                raise BadReply(
                    f"a sum check of its Commit answer lists {most} senders, past the round's "
                    f"{parts}"
                )
