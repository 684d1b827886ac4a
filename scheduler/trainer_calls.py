"""A trainer's calls to the job API (LeaseMicrobatches, ReportMicrobatches), bounded where they
enter it, and each under its own trainer id (`scheduler.trainer_keys`): any token holder may
make them."""

from __future__ import annotations

from collections.abc import Sized

from scheduler.trainer_keys import TrainerKeys
from swarm.errors import InvalidArgument
from swarm.job.schema import MAX_IN_FLIGHT
from swarm.proto import scheduler_pb2 as spb

__all__ = ["MAX_REPORTED", "MAX_TRAINER_ID_CHARS", "TrainerCalls", "trainer_call"]

# A trainer's calls, which any token holder may make: its id (kept by the coordinator a minute
# after its last call, and with each of its leases) is at most this long (swarm's own are under
# 100 characters), and a lease or report names at most this many microbatches in each of its
# lists (no more than a trainer's window may hold): 200,000 results in one
# report held the event loop 1.5 s in their conversion alone.
MAX_TRAINER_ID_CHARS = 256
MAX_REPORTED = MAX_IN_FLIGHT  # what a window may hold: `[runtime] max_in_flight`'s bound


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
