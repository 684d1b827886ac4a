"""A trainer's calls to the job API (LeaseMicrobatches, ReportMicrobatches), bounded where they
enter it, and each under its own trainer id (`scheduler.trainer_keys`): any token holder may
make them."""

from __future__ import annotations

from collections.abc import Sized

from scheduler.trainer_keys import TrainerKeys
from swarm.errors import InvalidArgument
from swarm.job.schema import MAX_IN_FLIGHT
from swarm.proto import scheduler_pb2 as spb

__all__ = [
    "MAX_REPORTED",
    "MAX_REPORT_ENTRIES",
    "MAX_TRAINER_ID_CHARS",
    "TrainerCalls",
    "trainer_call",
]

# A trainer's calls, which any token holder may make: its id (kept by the coordinator a minute
# after its last call, and with each of its leases) is at most this long (swarm's own are under
# 100 characters), and a lease or report names at most this many microbatches in each of its
# lists (no more than a trainer's window may hold): 200,000 results in one
# report held the event loop 1.5 s in their conversion alone.
MAX_TRAINER_ID_CHARS = 256
MAX_REPORTED = MAX_IN_FLIGHT  # what a window may hold: `[runtime] max_in_flight`'s bound
# What a report's results hold beside their microbatches, all of them together (holders, the
# route, the replicas touched, verdicts and their auditors, digests): a result's are a few per
# stage. One result of 2M empty digests (4 MiB) was 2M objects made on the event loop.
MAX_REPORT_ENTRIES = 1 << 18


def trainer_call(trainer: str, **lists: Sized) -> None:
    """InvalidArgument where a trainer's call is past its bounds (`MAX_TRAINER_ID_CHARS`,
    `MAX_REPORTED`), before any of it is read."""
    if len(trainer) > MAX_TRAINER_ID_CHARS:
        raise InvalidArgument(
            f"a trainer id of {len(trainer)} characters, over the {MAX_TRAINER_ID_CHARS} "
            "(swarm's MAX_TRAINER_ID_CHARS)"
        )
    for name, items in lists.items():
        if len(items) > MAX_REPORTED:
            raise InvalidArgument(
                f"{name}: {len(items)} microbatches in one call, over the {MAX_REPORTED} "
                "(swarm's MAX_REPORTED)"
            )


def _entries(r: spb.MicrobatchReport) -> int:
    """What a result holds beside its microbatch (each repeated field's length: no copy)."""
    lists = (r.holders, r.chain, r.back, r.verdicts, r.touched, r.digests)
    return sum(len(items) for items in lists)


class TrainerCalls:
    """A trainer's calls checked where they enter the job API: past their bounds
    (`trainer_call`), or under a trainer id another caller holds (`TrainerKeys`)."""

    def __init__(self, keys: TrainerKeys | None = None) -> None:
        self.keys = keys or TrainerKeys()

    def lease(self, request: spb.SchedulerLeaseMicrobatchesRequest, key: bytes) -> None:
        """A lease (or a report's `next`, with the report's `key`)."""
        trainer_call(request.trainer, working=request.working)
        self.keys.check(request.job, request.trainer, key)

    def report(self, request: spb.SchedulerReportMicrobatchesRequest) -> None:
        """A report, its `next` lease included: all of it, before any of it is taken."""
        trainer_call(request.trainer, results=request.results, released=request.released)
        entries = sum(_entries(r) for r in request.results)
        if entries <= MAX_REPORT_ENTRIES:  # its verdicts' auditors too, once they are few
            entries += sum(len(v.auditors) for r in request.results for v in r.verdicts)
        if entries > MAX_REPORT_ENTRIES:
            raise InvalidArgument(
                f"a report whose results hold {entries} entries (holders, routes, replicas "
                f"touched, verdicts, digests), over the {MAX_REPORT_ENTRIES} (swarm's "
                "MAX_REPORT_ENTRIES)"
            )
        if request.HasField("next") and request.next.job != request.job:
            # Only the report's job is checked as known: a next lease of another would bind its
            # trainer id under a job of any name, of any length, for an hour.
            raise InvalidArgument(
                "a report's next lease is of its own job, not another "
                f"({len(request.next.job)} characters)"
            )
        if request.HasField("next"):
            self.lease(request.next, request.trainer_key)
        self.keys.check(request.job, request.trainer, request.trainer_key)
